/**
 * Where the editor's view opens on a graph: the whole graph when that keeps node titles
 * legible, else the graph's inputs at a legible zoom (the minimap shows the rest).
 */

/** The smallest zoom a fit goes to: node titles (13 px) stay at least ~10 px tall on screen. */
export const LEGIBLE_ZOOM = 0.75;
export const MAX_FIT_ZOOM = 1.1;
/** Room around a fitted graph, as a share of its size. */
export const FIT_PADDING = 0.1;
/** Room left of (and above) the inputs when the view focuses them. */
export const FOCUS_MARGIN = 40;
/** The least room either side of a graph shown whole across the canvas at LEGIBLE_ZOOM. */
export const EDGE_MARGIN = 16;

export interface Rect {
  x: number;
  y: number;
  width: number;
  height: number;
}

export interface Size {
  width: number;
  height: number;
}

export interface Viewport {
  x: number;
  y: number;
  zoom: number;
}

/**
 * The viewport for a graph whose nodes span `all`, on a canvas of `canvas` pixels: `all`
 * fitted and centred when that zoom is at least LEGIBLE_ZOOM, else LEGIBLE_ZOOM with `focus`
 * (the inputs; `all` when null) centred vertically when it fits, from its top otherwise; across,
 * `all` centred when it is as wide as the canvas at that zoom (the padding a fit leaves is what
 * did not fit), else `focus` at the left edge.
 */
export function readableViewport(all: Rect, focus: Rect | null, canvas: { width: number; height: number }): Viewport {
  const fit = wholeFitZoom(all, canvas);
  if (fit >= LEGIBLE_ZOOM) {
    return {
      zoom: fit,
      x: canvas.width / 2 - (all.x + all.width / 2) * fit,
      y: canvas.height / 2 - (all.y + all.height / 2) * fit,
    };
  }
  const zoom = LEGIBLE_ZOOM;
  const target = focus ?? all;
  const fitsTall = target.height * zoom <= canvas.height - 2 * FOCUS_MARGIN;
  const fitsWide = all.width * zoom <= canvas.width - 2 * EDGE_MARGIN;
  return {
    zoom,
    x: fitsWide ? canvas.width / 2 - (all.x + all.width / 2) * zoom : FOCUS_MARGIN - target.x * zoom,
    y: fitsTall ? canvas.height / 2 - (target.y + target.height / 2) * zoom : FOCUS_MARGIN - target.y * zoom,
  };
}

/** The zoom that shows all of `all`, padded, on `canvas` (at most MAX_FIT_ZOOM); below LEGIBLE_ZOOM the
 * readable view opens at LEGIBLE_ZOOM instead. */
export function wholeFitZoom(all: Rect, canvas: { width: number; height: number }): number {
  return Math.min(
    canvas.width / Math.max(1, all.width * (1 + 2 * FIT_PADDING)),
    canvas.height / Math.max(1, all.height * (1 + 2 * FIT_PADDING)),
    MAX_FIT_ZOOM,
  );
}

/** Whether `viewport` shows all of `all` on `canvas` (else the view shows part of the graph). */
export function showsWhole(all: Rect, viewport: Viewport, canvas: { width: number; height: number }): boolean {
  const left = viewport.x + all.x * viewport.zoom;
  const top = viewport.y + all.y * viewport.zoom;
  const slack = 0.5; // rounding
  return left >= -slack && top >= -slack && left + all.width * viewport.zoom <= canvas.width + slack &&
    top + all.height * viewport.zoom <= canvas.height + slack;
}

/**
 * Whether a node of `nodes` (flow coordinates) that `viewport` shows whole lies in the `corner` of
 * the canvas's bottom right. A node the canvas's edge cuts is part of the rest of the graph, which
 * the minimap stands for.
 */
export function coversCorner(nodes: Rect[], viewport: Viewport, canvas: Size, corner: Size): boolean {
  const left = canvas.width - corner.width;
  const top = canvas.height - corner.height;
  return nodes.some((n) => {
    const x = viewport.x + n.x * viewport.zoom;
    const y = viewport.y + n.y * viewport.zoom;
    const right = x + n.width * viewport.zoom;
    const bottom = y + n.height * viewport.zoom;
    const shown = x >= 0 && y >= 0 && right <= canvas.width && bottom <= canvas.height;
    return shown && right > left && bottom > top;
  });
}

/**
 * The readable view (`readableViewport`) with no node of `nodes` that it shows whole under the
 * minimap, which covers `corner` in the canvas's bottom right. When the plain view puts a node there, the first of these
 * that clears the corner is taken: the same view moved up or left just enough (the smaller move),
 * else the graph fitted into the canvas left of the map or above it (the larger zoom). Each must
 * keep in view what the plain view shows whole (the graph, or its focus): legibility comes first,
 * and where nothing clears the corner the plain view stays (the map's Hide button clears it then).
 * With `mapWhenWhole` false the map is only drawn over a partial view, so a whole view makes no room for it.
 */
export function readableViewportBesideMap(
  all: Rect,
  focus: Rect | null,
  nodes: Rect[],
  canvas: Size,
  corner: Size,
  mapWhenWhole = true,
): Viewport {
  const plain = readableViewport(all, focus, canvas);
  const whole = showsWhole(all, plain, canvas);
  if ((whole && !mapWhenWhole) || !coversCorner(nodes, plain, canvas, corner)) return plain;
  const kept = whole ? all : focus && showsWhole(focus, plain, canvas) ? focus : null;
  const clear = (vp: Viewport) =>
    (!kept || showsWhole(kept, vp, canvas)) && !coversCorner(nodes, vp, canvas, corner);
  const covered = nodes.filter((n) => coversCorner([n], plain, canvas, corner));
  const below = Math.max(...covered.map((n) => plain.y + (n.y + n.height) * plain.zoom)) - (canvas.height - corner.height);
  const right = Math.max(...covered.map((n) => plain.x + (n.x + n.width) * plain.zoom)) - (canvas.width - corner.width);
  const moves = [{ ...plain, y: plain.y - below }, { ...plain, x: plain.x - right }]
    .filter(clear)
    .sort((a, b) => Math.abs(a.x - plain.x) + Math.abs(a.y - plain.y) - (Math.abs(b.x - plain.x) + Math.abs(b.y - plain.y)));
  if (moves.length > 0) return moves[0];
  const refits = [
    readableViewport(all, focus, { width: canvas.width - corner.width, height: canvas.height }),
    readableViewport(all, focus, { width: canvas.width, height: canvas.height - corner.height }),
  ].filter(clear);
  if (refits.length === 0) return plain;
  return refits.reduce((best, vp) => (vp.zoom > best.zoom ? vp : best));
}

/** The smallest rectangle holding every one of `rects` (null for none). */
export function union(rects: Rect[]): Rect | null {
  if (rects.length === 0) return null;
  const x = Math.min(...rects.map((r) => r.x));
  const y = Math.min(...rects.map((r) => r.y));
  const right = Math.max(...rects.map((r) => r.x + r.width));
  const bottom = Math.max(...rects.map((r) => r.y + r.height));
  return { x, y, width: right - x, height: bottom - y };
}
