import { describe, expect, it } from "vitest";
import {
  EDGE_MARGIN,
  FIT_PADDING,
  FOCUS_MARGIN,
  LEGIBLE_ZOOM,
  MAX_FIT_ZOOM,
  type Rect,
  type Corners,
  NO_CORNER,
  coversCorners,
  readableViewport,
  readableViewportClearOfCorners,
  showsWhole,
  union,
  wholeFitZoom,
} from "./viewport";

const canvas = { width: 800, height: 600 };

describe("the view a graph opens with", () => {
  it("fits a small graph whole, centred, at most MAX_FIT_ZOOM", () => {
    const vp = readableViewport({ x: 0, y: 0, width: 200, height: 100 }, null, canvas);
    expect(vp.zoom).toBe(MAX_FIT_ZOOM);
    expect(vp.x + 100 * vp.zoom).toBeCloseTo(400);
    expect(vp.y + 50 * vp.zoom).toBeCloseTo(300);
  });

  it("never goes below a legible zoom: it shows the inputs instead", () => {
    const all = { x: 0, y: 0, width: 4000, height: 1500 };
    const inputs = { x: 20, y: 100, width: 210, height: 400 };
    const vp = readableViewport(all, inputs, canvas);
    expect(vp.zoom).toBe(LEGIBLE_ZOOM);
    expect(vp.x + inputs.x * vp.zoom).toBeCloseTo(FOCUS_MARGIN); // the inputs at the left edge
    expect(vp.y + (inputs.y + inputs.height / 2) * vp.zoom).toBeCloseTo(300); // centred when they fit
    const tall = { x: 20, y: 0, width: 210, height: 2000 };
    expect(readableViewport(all, tall, canvas).y).toBeCloseTo(FOCUS_MARGIN); // from the top when they do not
  });

  it("shows a graph whole across at the legible zoom when it is that wide, centred", () => {
    // Too big to fit with the padding at LEGIBLE_ZOOM, narrow enough to show whole without it.
    const all = { x: 0, y: 0, width: (canvas.width - 2 * EDGE_MARGIN) / LEGIBLE_ZOOM, height: 1500 };
    const inputs = { x: 0, y: 100, width: 230, height: 100 };
    const vp = readableViewport(all, inputs, canvas);
    expect(vp.zoom).toBe(LEGIBLE_ZOOM);
    expect(vp.x).toBeCloseTo(EDGE_MARGIN); // its left end and its right end both in view
    expect(vp.x + all.width * vp.zoom).toBeCloseTo(canvas.width - EDGE_MARGIN);
    expect(vp.y + (inputs.y + inputs.height / 2) * vp.zoom).toBeCloseTo(300); // the inputs, still
    const wider = { ...all, width: all.width + 10 };
    expect(readableViewport(wider, inputs, canvas).x).toBeCloseTo(FOCUS_MARGIN); // any wider: the inputs at the left
  });

  it("says whether the readable view shows the whole graph", () => {
    const small = { x: 0, y: 0, width: 200, height: 100 };
    expect(wholeFitZoom(small, canvas)).toBe(MAX_FIT_ZOOM);
    const big = { x: 0, y: 0, width: 4000, height: 1500 };
    expect(wholeFitZoom(big, canvas)).toBeCloseTo(canvas.width / (4000 * (1 + 2 * FIT_PADDING)));
    expect(wholeFitZoom(big, canvas)).toBeLessThan(LEGIBLE_ZOOM); // the view shows part of it
    expect(readableViewport(big, null, canvas).zoom).toBe(LEGIBLE_ZOOM);
    expect(showsWhole(big, readableViewport(big, null, canvas), canvas)).toBe(false);
    expect(showsWhole(small, readableViewport(small, null, canvas), canvas)).toBe(true);
    // Too big to fit with the padding, small enough to show whole at the legible zoom without it.
    const snug = { x: 0, y: 0, width: (canvas.width - 2 * EDGE_MARGIN) / LEGIBLE_ZOOM, height: 300 };
    expect(wholeFitZoom(snug, canvas)).toBeLessThan(LEGIBLE_ZOOM);
    expect(showsWhole(snug, readableViewport(snug, null, canvas), canvas)).toBe(true);
  });

  it("unites rectangles", () => {
    expect(union([])).toBeNull();
    expect(union([{ x: 0, y: 5, width: 10, height: 10 }, { x: -5, y: 0, width: 5, height: 30 }])).toEqual({
      x: -5, y: 0, width: 15, height: 30,
    });
  });
});

describe("fit-to-view beside the minimap", () => {
  const corner: Corners = { left: NO_CORNER, right: { width: 160, height: 140 } };
  /** A row of `n` nodes 230x80, 300 apart, the last one `drop` px lower: a graph whose bottom right is a node. */
  const row = (n: number, drop = 0): Rect[] =>
    Array.from({ length: n }, (_, i) => ({ x: i * 300, y: i === n - 1 ? drop : 0, width: 230, height: 80 }));
  const onScreen = (r: Rect, vp: { x: number; y: number; zoom: number }) => ({
    left: vp.x + r.x * vp.zoom,
    top: vp.y + r.y * vp.zoom,
    right: vp.x + (r.x + r.width) * vp.zoom,
    bottom: vp.y + (r.y + r.height) * vp.zoom,
  });

  it("finds a node in the map's corner, and only there", () => {
    const vp = { x: 0, y: 0, zoom: 1 };
    expect(coversCorners([{ x: 700, y: 500, width: 50, height: 50 }], vp, canvas, corner)).toBe(true);
    expect(coversCorners([{ x: 600, y: 500, width: 39, height: 50 }], vp, canvas, corner)).toBe(false); // left of it
    expect(coversCorners([{ x: 700, y: 400, width: 50, height: 59 }], vp, canvas, corner)).toBe(false); // above it
    expect(coversCorners([{ x: 900, y: 500, width: 50, height: 50 }], vp, canvas, corner)).toBe(false); // off the canvas
    expect(coversCorners([{ x: 700, y: 500, width: 150, height: 50 }], vp, canvas, corner)).toBe(false); // cut by its edge
  });

  it("keeps the plain fit when no node lies under the map", () => {
    const nodes = row(2);
    const all = union(nodes)!;
    expect(readableViewportClearOfCorners(all, null, nodes, canvas, corner)).toEqual(readableViewport(all, null, canvas));
  });

  it("moves a whole view up just enough when its last node would lie under the map", () => {
    const wide = { width: 900, height: 700 };
    const nodes: Rect[] = [{ x: 0, y: 0, width: 230, height: 80 }, { x: 670, y: 520, width: 230, height: 80 }];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, wide);
    expect(coversCorners(nodes, plain, wide, corner)).toBe(true);
    const vp = readableViewportClearOfCorners(all, null, nodes, wide, corner);
    expect(vp.zoom).toBe(plain.zoom); // as large as the plain fit
    expect(vp.x).toBe(plain.x);
    expect(onScreen(nodes[1], vp).bottom).toBeCloseTo(wide.height - corner.right.height); // up to the map's top, no more
    expect(coversCorners(nodes, vp, wide, corner)).toBe(false);
    expect(showsWhole(all, vp, wide)).toBe(true);
  });

  it("fits the graph left of the map when no move clears it, if it stays whole and legible", () => {
    const small = { width: 900, height: 660 };
    const nodes: Rect[] = [{ x: 0, y: 0, width: 230, height: 80 }, { x: 570, y: 500, width: 230, height: 80 }];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, small);
    expect(coversCorners(nodes, plain, small, corner)).toBe(true);
    const vp = readableViewportClearOfCorners(all, null, nodes, small, corner);
    const left = readableViewport(all, null, { width: small.width - corner.right.width, height: small.height });
    expect(vp).toEqual(left);
    expect(vp.zoom).toBeLessThan(plain.zoom);
    expect(vp.zoom).toBeGreaterThanOrEqual(LEGIBLE_ZOOM);
    expect(coversCorners(nodes, vp, small, corner)).toBe(false);
    expect(showsWhole(all, vp, small)).toBe(true);
    const last = onScreen(nodes[1], vp);
    expect(last.right).toBeLessThanOrEqual(small.width - corner.right.width);
  });

  it("keeps a whole graph whole rather than clear of the map", () => {
    // As wide as the canvas allows at the legible zoom: neither beside the map nor above it is it whole.
    const width = (canvas.width - 2 * EDGE_MARGIN) / LEGIBLE_ZOOM;
    const nodes: Rect[] = [
      { x: 0, y: 0, width: 230, height: 80 },
      { x: width - 230, y: 600, width: 230, height: 80 },
    ];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, canvas);
    expect(showsWhole(all, plain, canvas)).toBe(true);
    expect(coversCorners(nodes, plain, canvas, corner)).toBe(true);
    expect(readableViewportClearOfCorners(all, null, nodes, canvas, corner)).toEqual(plain);
  });

  it("leaves a whole view alone where the map is only drawn over partial ones (a run's graph)", () => {
    const nodes = row(3, 320);
    const all = union(nodes)!;
    expect(readableViewportClearOfCorners(all, null, nodes, canvas, corner, false)).toEqual(readableViewport(all, null, canvas));
  });

  it("moves a partial view up when that clears the map and keeps its inputs in view", () => {
    // Too wide to fit legibly: the view shows the inputs at the legible zoom, centred, with the rest to the right.
    const wide = { width: 1300, height: 300 };
    const inputs: Rect[] = [{ x: 0, y: 200, width: 230, height: 80 }];
    const nodes: Rect[] = [...inputs, { x: 1450, y: 230, width: 230, height: 80 }, { x: 3000, y: 0, width: 230, height: 80 }];
    const all = union(nodes)!;
    const focus = union(inputs)!;
    const plain = readableViewport(all, focus, wide);
    expect(plain.zoom).toBe(LEGIBLE_ZOOM);
    expect(coversCorners(nodes, plain, wide, corner)).toBe(true);
    const vp = readableViewportClearOfCorners(all, focus, nodes, wide, corner);
    expect(vp.zoom).toBe(LEGIBLE_ZOOM);
    expect(vp.x).toBe(plain.x);
    expect(onScreen(nodes[1], vp).bottom).toBeCloseTo(wide.height - corner.right.height);
    expect(coversCorners(nodes, vp, wide, corner)).toBe(false);
    expect(showsWhole(focus, vp, wide)).toBe(true); // the inputs still in view
    // a canvas too short to keep the inputs in view and clear the map: the plain view stays
    const short = { width: 1300, height: 200 };
    const tight = readableViewport(all, focus, short);
    expect(coversCorners(nodes, tight, short, corner)).toBe(true);
    expect(readableViewportClearOfCorners(all, focus, nodes, short, corner)).toEqual(tight);
  });
});

describe("fit-to-view clear of the zoom buttons", () => {
  // The editor's: buttons bottom left, the map bottom right (components/FlowControls.tsx, FlowMiniMap.tsx).
  const corners: Corners = { left: { width: 51, height: 103 }, right: { width: 157, height: 142 } };
  const bottomLeft = (canvasSize: { width: number; height: number }, r: Rect, vp: { x: number; y: number; zoom: number }) => ({
    left: vp.x + r.x * vp.zoom,
    bottom: vp.y + (r.y + r.height) * vp.zoom - canvasSize.height,
  });

  it("finds a node in the buttons' corner, and only there", () => {
    const vp = { x: 0, y: 0, zoom: 1 };
    expect(coversCorners([{ x: 10, y: 520, width: 30, height: 30 }], vp, canvas, corners)).toBe(true);
    expect(coversCorners([{ x: 51, y: 520, width: 30, height: 30 }], vp, canvas, corners)).toBe(false); // right of it
    expect(coversCorners([{ x: 10, y: 467, width: 30, height: 30 }], vp, canvas, corners)).toBe(false); // above it
    expect(coversCorners([{ x: -10, y: 520, width: 30, height: 30 }], vp, canvas, corners)).toBe(false); // cut by the edge
    expect(coversCorners([{ x: 10, y: 520, width: 30, height: 30 }], vp, canvas, { ...corners, left: NO_CORNER })).toBe(false);
  });

  it("moves a partial view right, off the buttons, when an input sits low at the left edge", () => {
    // Too wide to fit legibly: the inputs at FOCUS_MARGIN from the left, centred, the lower one over the buttons.
    const wide = { width: 1000, height: 400 };
    const inputs: Rect[] = [{ x: 0, y: 0, width: 230, height: 80 }, { x: 0, y: 320, width: 230, height: 80 }];
    const nodes: Rect[] = [...inputs, { x: 3000, y: 0, width: 230, height: 80 }];
    const all = union(nodes)!;
    const focus = union(inputs)!;
    const plain = readableViewport(all, focus, wide);
    expect(plain.zoom).toBe(LEGIBLE_ZOOM);
    expect(bottomLeft(wide, inputs[1], plain)).toEqual({ left: FOCUS_MARGIN, bottom: -50 }); // in the buttons' corner
    expect(coversCorners(nodes, plain, wide, corners)).toBe(true);
    const vp = readableViewportClearOfCorners(all, focus, nodes, wide, corners);
    // Up would take the upper input out of view: right, just past the buttons' corner.
    expect(vp).toEqual({ ...plain, x: plain.x + corners.left.width - FOCUS_MARGIN });
    expect(coversCorners(nodes, vp, wide, corners)).toBe(false);
    expect(showsWhole(focus, vp, wide)).toBe(true);
  });

  it("clears the buttons of a whole view where the map is only drawn over partial ones (a run's graph)", () => {
    // As wide as the canvas at the legible zoom, shown whole EDGE_MARGIN from its edges; its bottom-left node low.
    const tall = { width: 800, height: 700 };
    const nodes: Rect[] = [
      { x: 0, y: 0, width: 230, height: 80 },
      { x: 0, y: 600, width: 230, height: 80 },
      { x: (tall.width - 2 * EDGE_MARGIN) / LEGIBLE_ZOOM - 230, y: 0, width: 230, height: 80 },
    ];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, tall);
    expect(plain.x).toBeCloseTo(EDGE_MARGIN);
    expect(showsWhole(all, plain, tall)).toBe(true);
    expect(readableViewportClearOfCorners(all, null, nodes, tall, { ...corners, left: NO_CORNER }, false)).toEqual(plain);
    const vp = readableViewportClearOfCorners(all, null, nodes, tall, corners, false);
    expect(vp.zoom).toBe(plain.zoom);
    expect(vp.x).toBe(plain.x); // right would push its right end out of view: up, to the buttons' top, no more
    expect(bottomLeft(tall, nodes[1], vp).bottom).toBeCloseTo(-corners.left.height);
    expect(coversCorners(nodes, vp, tall, corners)).toBe(false);
    expect(showsWhole(all, vp, tall)).toBe(true);
  });

  it("clears both corners at once: refitted beside the buttons when no single move clears both", () => {
    // The inputs at the left edge, a node under the buttons and one under the map: up takes the upper
    // input out of view, off the map takes the inputs out, off the buttons leaves the map's node under it.
    const wide = { width: 1000, height: 500 };
    const nodes: Rect[] = [
      { x: 0, y: 0, width: 230, height: 80 },
      { x: 0, y: 420, width: 230, height: 80 },
      { x: 1000, y: 420, width: 230, height: 80 },
      { x: 3000, y: 0, width: 230, height: 80 },
    ];
    const all = union(nodes)!;
    const focus = union(nodes.slice(0, 2))!;
    const plain = readableViewport(all, focus, wide);
    expect(coversCorners(nodes, plain, wide, { ...corners, right: NO_CORNER })).toBe(true);
    expect(coversCorners(nodes, plain, wide, { ...corners, left: NO_CORNER })).toBe(true);
    const vp = readableViewportClearOfCorners(all, focus, nodes, wide, corners);
    expect(vp).toEqual({ ...plain, x: corners.left.width + FOCUS_MARGIN }); // the map's node now past the edge
    expect(coversCorners(nodes, vp, wide, corners)).toBe(false);
    expect(showsWhole(focus, vp, wide)).toBe(true);
  });
});
