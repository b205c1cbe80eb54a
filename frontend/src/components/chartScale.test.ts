import { describe, expect, it } from "vitest";
import { percentTick } from "../api/cluster";
import { byteUnit, niceScale, ticksOf, timeAxisRightPad, timeLabel, WIDE_TIMES } from "./chartScale";

const MiB = 1024 ** 2;
const GiB = 1024 ** 3;

describe("niceScale", () => {
  it("ends on a tick above the highest value, even with sparse ticks", () => {
    // A worker's RSS of 130 MiB on a 120 px chart (3 ticks): 0, 50, 100, 150 MiB, not a top label below the line.
    const s = niceScale(130 * MiB, 3, byteUnit(130 * MiB));
    expect(s).toEqual({ top: 150 * MiB, step: 50 * MiB });
    expect(ticksOf(0, s)).toEqual([0, 50 * MiB, 100 * MiB, 150 * MiB]);
  });

  it("leaves headroom when the value sits on a step", () => {
    expect(niceScale(100 * MiB, 4, MiB)).toEqual({ top: 150 * MiB, step: 50 * MiB });
    expect(niceScale(1.8 * GiB, 3, byteUnit(1.8 * GiB)).top).toBe(2 * GiB);
  });

  it("scales fractions (occupancy) and empty series", () => {
    expect(niceScale(0.3, 3)).toEqual({ top: 0.4, step: 0.1 });
    expect(niceScale(0, 3)).toEqual({ top: 1, step: 1 });
    expect(niceScale(Number.NaN, 3)).toEqual({ top: 1, step: 1 });
  });

  it("always puts the top above the value", () => {
    for (const max of [1, 7, 9.99, 10, 11, 99, 123456, 3.3 * GiB]) {
      for (const ticks of [2, 3, 4, 6]) {
        const s = niceScale(max, ticks, byteUnit(max));
        expect(s.top).toBeGreaterThan(max);
        expect(ticksOf(0, s).length).toBeLessThanOrEqual(2 * ticks + 2);
      }
    }
  });
});

describe("byteUnit", () => {
  it("reads bytes in binary units", () => {
    expect(byteUnit(500)).toBe(1);
    expect(byteUnit(3 * 1024)).toBe(1024);
    expect(byteUnit(130 * MiB)).toBe(MiB);
    expect(byteUnit(2 * GiB)).toBe(GiB);
  });
});

describe("a following axis's labels", () => {
  it("are distinct when written with the scale's own step (occupancy at 1.6% read 0%, 1%, 1%, 2%, 2%)", () => {
    for (const max of [0.004, 0.016, 0.0213, 0.08, 0.33, 0.97]) {
      for (const ticks of [2, 3, 4, 6]) {
        const scale = niceScale(max, ticks);
        const labels = ticksOf(0, scale).map((v) => percentTick(v, scale.step));
        expect(new Set(labels).size, `${max} over ${ticks} ticks: ${labels.join(", ")}`).toBe(labels.length);
      }
    }
  });
});

describe("timeAxisRightPad", () => {
  it("leaves room for half of the widest time label past the plot's right end", () => {
    const perChar = (label: string) => 7 * label.length; // a stand-in for the canvas's measureText
    const widest = Math.max(...WIDE_TIMES.map((t) => perChar(timeLabel(t))));
    expect(timeAxisRightPad(perChar)).toBeGreaterThanOrEqual(widest / 2);
    expect(timeAxisRightPad(perChar)).toBeLessThanOrEqual(widest / 2 + 3);
    // "10:52:00 PM" at 12 px is about 70 px wide: more than the 25 px uPlot leaves by itself
    expect(timeAxisRightPad(() => 70)).toBe(37);
  });
});
