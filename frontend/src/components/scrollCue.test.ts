import { describe, expect, it } from "vitest";
import { hiddenSides } from "./scrollCue";

describe("a scrolling table's cue", () => {
  it("shows nothing when the table fits, rounding included", () => {
    expect(hiddenSides({ scrollLeft: 0, scrollWidth: 740, clientWidth: 740 })).toEqual({ left: false, right: false });
    expect(hiddenSides({ scrollLeft: 0, scrollWidth: 740.6, clientWidth: 740 })).toEqual({ left: false, right: false });
  });

  it("points right while columns are hidden there, left once scrolled past some", () => {
    expect(hiddenSides({ scrollLeft: 0, scrollWidth: 860, clientWidth: 740 })).toEqual({ left: false, right: true });
    expect(hiddenSides({ scrollLeft: 60, scrollWidth: 860, clientWidth: 740 })).toEqual({ left: true, right: true });
    expect(hiddenSides({ scrollLeft: 120, scrollWidth: 860, clientWidth: 740 })).toEqual({ left: true, right: false });
  });
});
