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

/** The smallest rectangle holding every one of `rects` (null for none). */
export function union(rects: Rect[]): Rect | null {
  if (rects.length === 0) return null;
  const x = Math.min(...rects.map((r) => r.x));
  const y = Math.min(...rects.map((r) => r.y));
  const right = Math.max(...rects.map((r) => r.x + r.width));
  const bottom = Math.max(...rects.map((r) => r.y + r.height));
  return { x, y, width: right - x, height: bottom - y };
}
