import { describe, expect, it } from "vitest";
import { EDGE_MARGIN, FIT_PADDING, FOCUS_MARGIN, LEGIBLE_ZOOM, MAX_FIT_ZOOM, readableViewport, showsWhole, union, wholeFitZoom } from "./viewport";

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
