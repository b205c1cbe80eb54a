import { describe, expect, it } from "vitest";
import {
  EDGE_MARGIN,
  FIT_PADDING,
  FOCUS_MARGIN,
  LEGIBLE_ZOOM,
  MAX_FIT_ZOOM,
  type Rect,
  coversCorner,
  readableViewport,
  readableViewportBesideMap,
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
  const corner = { width: 160, height: 140 };
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
    expect(coversCorner([{ x: 700, y: 500, width: 50, height: 50 }], vp, canvas, corner)).toBe(true);
    expect(coversCorner([{ x: 600, y: 500, width: 39, height: 50 }], vp, canvas, corner)).toBe(false); // left of it
    expect(coversCorner([{ x: 700, y: 400, width: 50, height: 59 }], vp, canvas, corner)).toBe(false); // above it
    expect(coversCorner([{ x: 900, y: 500, width: 50, height: 50 }], vp, canvas, corner)).toBe(false); // off the canvas
    expect(coversCorner([{ x: 700, y: 500, width: 150, height: 50 }], vp, canvas, corner)).toBe(false); // cut by its edge
  });

  it("keeps the plain fit when no node lies under the map", () => {
    const nodes = row(2);
    const all = union(nodes)!;
    expect(readableViewportBesideMap(all, null, nodes, canvas, corner)).toEqual(readableViewport(all, null, canvas));
  });

  it("moves a whole view up just enough when its last node would lie under the map", () => {
    const wide = { width: 900, height: 700 };
    const nodes: Rect[] = [{ x: 0, y: 0, width: 230, height: 80 }, { x: 670, y: 520, width: 230, height: 80 }];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, wide);
    expect(coversCorner(nodes, plain, wide, corner)).toBe(true);
    const vp = readableViewportBesideMap(all, null, nodes, wide, corner);
    expect(vp.zoom).toBe(plain.zoom); // as large as the plain fit
    expect(vp.x).toBe(plain.x);
    expect(onScreen(nodes[1], vp).bottom).toBeCloseTo(wide.height - corner.height); // up to the map's top, no more
    expect(coversCorner(nodes, vp, wide, corner)).toBe(false);
    expect(showsWhole(all, vp, wide)).toBe(true);
  });

  it("fits the graph left of the map when no move clears it, if it stays whole and legible", () => {
    const small = { width: 900, height: 660 };
    const nodes: Rect[] = [{ x: 0, y: 0, width: 230, height: 80 }, { x: 570, y: 500, width: 230, height: 80 }];
    const all = union(nodes)!;
    const plain = readableViewport(all, null, small);
    expect(coversCorner(nodes, plain, small, corner)).toBe(true);
    const vp = readableViewportBesideMap(all, null, nodes, small, corner);
    const left = readableViewport(all, null, { width: small.width - corner.width, height: small.height });
    expect(vp).toEqual(left);
    expect(vp.zoom).toBeLessThan(plain.zoom);
    expect(vp.zoom).toBeGreaterThanOrEqual(LEGIBLE_ZOOM);
    expect(coversCorner(nodes, vp, small, corner)).toBe(false);
    expect(showsWhole(all, vp, small)).toBe(true);
    const last = onScreen(nodes[1], vp);
    expect(last.right).toBeLessThanOrEqual(small.width - corner.width);
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
    expect(coversCorner(nodes, plain, canvas, corner)).toBe(true);
    expect(readableViewportBesideMap(all, null, nodes, canvas, corner)).toEqual(plain);
  });

  it("leaves a whole view alone where the map is only drawn over partial ones (a run's graph)", () => {
    const nodes = row(3, 320);
    const all = union(nodes)!;
    expect(readableViewportBesideMap(all, null, nodes, canvas, corner, false)).toEqual(readableViewport(all, null, canvas));
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
    expect(coversCorner(nodes, plain, wide, corner)).toBe(true);
    const vp = readableViewportBesideMap(all, focus, nodes, wide, corner);
    expect(vp.zoom).toBe(LEGIBLE_ZOOM);
    expect(vp.x).toBe(plain.x);
    expect(onScreen(nodes[1], vp).bottom).toBeCloseTo(wide.height - corner.height);
    expect(coversCorner(nodes, vp, wide, corner)).toBe(false);
    expect(showsWhole(focus, vp, wide)).toBe(true); // the inputs still in view
    // a canvas too short to keep the inputs in view and clear the map: the plain view stays
    const short = { width: 1300, height: 200 };
    const tight = readableViewport(all, focus, short);
    expect(coversCorner(nodes, tight, short, corner)).toBe(true);
    expect(readableViewportBesideMap(all, focus, nodes, short, corner)).toEqual(tight);
  });
});
