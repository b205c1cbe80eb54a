import { describe, expect, it } from "vitest";
import { describeTime } from "./time";

const NOW = new Date("2026-12-06T22:40:00Z");
const at = (iso: string) => describeTime(iso, NOW, { locale: "en-US", timeZone: "UTC" });

describe("a timestamp as the lists show it", () => {
  it("has its date even today, how long ago, and the full instant for a tooltip", () => {
    expect(at("2026-12-06T22:38:05Z")).toEqual({
      text: "Dec 6, 10:38 PM",
      relative: "2 minutes ago",
      full: "Sunday, December 6, 2026 at 10:38:05 PM UTC",
    });
  });

  it("names the year only when it is not this year's", () => {
    expect(at("2026-03-01T08:00:00Z")?.text).toBe("Mar 1, 08:00 AM");
    expect(at("2025-12-31T23:00:00Z")?.text).toBe("Dec 31, 2025, 11:00 PM");
  });

  it.each([
    ["2026-12-06T22:39:30Z", "just now"],
    ["2026-12-06T22:50:00Z", "just now"], // the browser's clock behind the server's: never "in 10 minutes"
    ["2026-12-06T22:39:00Z", "1 minute ago"],
    ["2026-12-06T19:40:00Z", "3 hours ago"],
    ["2026-12-05T20:00:00Z", "yesterday"],
    ["2026-11-26T22:40:00Z", "10 days ago"],
    ["2026-09-06T22:40:00Z", "3 months ago"],
    ["2024-12-06T22:40:00Z", "2 years ago"],
  ])("%s reads %s", (iso, relative) => {
    expect(at(iso)?.relative).toBe(relative);
  });

  it("is null for a missing or unreadable timestamp", () => {
    expect(at("")).toBeNull();
    expect(describeTime(null)).toBeNull();
    expect(at("not a time")).toBeNull();
  });
});
