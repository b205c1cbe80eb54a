import { describe, expect, it } from "vitest";
import { ZOOM_MIN_SIDE, zoomFactor } from "./zoom";

const ROOM = { width: 1325, height: 756 }; // 92vw x 84vh of a 1440x900 window: the lightbox's bounds

describe("zoomFactor", () => {
  it("enlarges a picture smaller than its thumbnail by a whole factor, to the least side", () => {
    // image_generation's 64x64 decode: 8x, 512 px (its thumbnail is 96 px)
    expect(zoomFactor({ width: 64, height: 64 }, ROOM)).toBe(8);
    expect(64 * zoomFactor({ width: 64, height: 64 }, ROOM)).toBe(ZOOM_MIN_SIDE);
    expect(zoomFactor({ width: 256, height: 128 }, ROOM)).toBe(2);
    expect(zoomFactor({ width: 100, height: 30 }, ROOM)).toBe(6); // ceil(512 / 100)
  });

  it("never enlarges past the room", () => {
    expect(zoomFactor({ width: 64, height: 64 }, { width: 300, height: 200 })).toBe(3);
    expect(zoomFactor({ width: 8, height: 400 }, ROOM)).toBe(1);
  });

  it("draws a picture already large enough, or of unknown size, at its own size", () => {
    expect(zoomFactor({ width: 512, height: 512 }, ROOM)).toBe(1);
    expect(zoomFactor({ width: 4000, height: 3000 }, ROOM)).toBe(1); // the CSS bounds shrink it
    expect(zoomFactor({ width: 0, height: 0 }, ROOM)).toBe(1); // not loaded yet
  });
});
