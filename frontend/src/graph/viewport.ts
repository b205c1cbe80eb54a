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
 * What the canvas draws over the graph in its bottom corners, each as the size it takes from its
 * corner (margins and a gap included): the zoom and fit buttons bottom left, the minimap and its
 * Hide button bottom right. Fit-to-view keeps the nodes it shows whole out of both.
 */
export interface Corners {
  left: Size;
  right: Size;
}

/** A corner nothing is drawn in. */
export const NO_CORNER: Size = { width: 0, height: 0 };

/** The corners' rectangles on a canvas of `canvas` pixels (those with an area). */
function cornerRects(canvas: Size, corners: Corners): Rect[] {
  const { left, right } = corners;
  return [
    { x: 0, y: canvas.height - left.height, width: left.width, height: left.height },
    { x: canvas.width - right.width, y: canvas.height - right.height, width: right.width, height: right.height },
  ].filter((r) => r.width > 0 && r.height > 0);
}

/** `node` (flow coordinates) on the canvas under `viewport` (canvas pixels). */
function onCanvas(node: Rect, viewport: Viewport): Rect {
  return {
    x: viewport.x + node.x * viewport.zoom,
    y: viewport.y + node.y * viewport.zoom,
    width: node.width * viewport.zoom,
    height: node.height * viewport.zoom,
  };
}

function overlap(a: Rect, b: Rect): boolean {
  return a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
}

/**
 * The nodes of `nodes` (flow coordinates) that `viewport` shows whole and that lie in a corner of
 * `corners`, on the canvas (canvas pixels), each with the corners it lies in. A node the canvas's
 * edge cuts is part of the rest of the graph, which the minimap stands for.
 */
function coveredNodes(nodes: Rect[], viewport: Viewport, canvas: Size, corners: Corners): { node: Rect; under: Rect[] }[] {
  const rects = cornerRects(canvas, corners);
  return nodes
    .map((n) => onCanvas(n, viewport))
    .filter((r) => r.x >= 0 && r.y >= 0 && r.x + r.width <= canvas.width && r.y + r.height <= canvas.height)
    .map((node) => ({ node, under: rects.filter((c) => overlap(node, c)) }))
    .filter((c) => c.under.length > 0);
}

/** Whether a node of `nodes` that `viewport` shows whole lies in a corner of `corners` (`coveredNodes`). */
export function coversCorners(nodes: Rect[], viewport: Viewport, canvas: Size, corners: Corners): boolean {
  return coveredNodes(nodes, viewport, canvas, corners).length > 0;
}

/**
 * The readable view (`readableViewport`) with no node of `nodes` that it shows whole in a corner of
 * `corners` (the zoom buttons bottom left, the minimap bottom right). When the plain view puts a node
 * there, the first of these that clears both corners is taken: the same view moved up, left (off the
 * map) or right (off the buttons) just enough (the smallest move), else the graph fitted into the
 * canvas beside the map, beside the buttons, between them or above them (the largest zoom). Each must
 * keep in view what the plain view shows whole (the graph, or its focus): legibility comes first, and
 * where nothing clears the corners the plain view stays (the map's Hide button clears its corner then).
 * With `mapWhenWhole` false the map is only drawn over a partial view, so a whole view makes no room
 * for it (the buttons are always drawn).
 */
export function readableViewportClearOfCorners(
  all: Rect,
  focus: Rect | null,
  nodes: Rect[],
  canvas: Size,
  corners: Corners,
  mapWhenWhole = true,
): Viewport {
  const plain = readableViewport(all, focus, canvas);
  const whole = showsWhole(all, plain, canvas);
  const drawn = whole && !mapWhenWhole ? { ...corners, right: NO_CORNER } : corners;
  const covered = coveredNodes(nodes, plain, canvas, drawn);
  if (covered.length === 0) return plain;
  const kept = whole ? all : focus && showsWhole(focus, plain, canvas) ? focus : null;
  const clear = (vp: Viewport) =>
    (!kept || showsWhole(kept, vp, canvas)) && !coversCorners(nodes, vp, canvas, drawn);
  const most = (shifts: number[]) => (shifts.length > 0 ? Math.max(...shifts) : null);
  const up = most(covered.flatMap(({ node, under }) => under.map((c) => node.y + node.height - c.y)));
  const mapX = canvas.width - drawn.right.width;
  const buttonsX = drawn.left.width;
  const left = most(covered.filter(({ node }) => node.x + node.width > mapX).map(({ node }) => node.x + node.width - mapX));
  const right = most(covered.filter(({ node }) => node.x < buttonsX).map(({ node }) => buttonsX - node.x));
  const moves = [
    up === null ? null : { ...plain, y: plain.y - up },
    left === null ? null : { ...plain, x: plain.x - left },
    right === null ? null : { ...plain, x: plain.x + right },
  ]
    .filter((vp): vp is Viewport => vp !== null && clear(vp))
    .sort((a, b) => Math.abs(a.x - plain.x) + Math.abs(a.y - plain.y) - (Math.abs(b.x - plain.x) + Math.abs(b.y - plain.y)));
  if (moves.length > 0) return moves[0];
  const within = (x: number, size: Size): Viewport => {
    const vp = readableViewport(all, focus, size);
    return { ...vp, x: vp.x + x };
  };
  const below = Math.max(drawn.left.height, drawn.right.height);
  const refits = [
    within(0, { width: canvas.width - drawn.right.width, height: canvas.height }),
    within(0, { width: canvas.width, height: canvas.height - below }),
    within(buttonsX, { width: canvas.width - buttonsX, height: canvas.height }),
    within(buttonsX, { width: canvas.width - buttonsX - drawn.right.width, height: canvas.height }),
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
