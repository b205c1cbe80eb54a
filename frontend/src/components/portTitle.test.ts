import { describe, expect, it } from "vitest";
import { portTitle } from "./SpecNodeView";

describe("a port label's hover text", () => {
  it("names the port in full, its type, join and description", () => {
    expect(portTitle("tokens", { type: "tokens", optional: true, description: "prompt as token ids" })).toBe(
      "tokens?: tokens — prompt as token ids",
    );
    expect(portTitle("items", { type: "json", join: "all" })).toBe("items: json (join: all)");
  });
});
