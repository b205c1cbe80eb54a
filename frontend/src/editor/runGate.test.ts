import { describe, expect, it } from "vitest";
import { runGate } from "./runGate";

describe("runGate", () => {
  it("asks for a first save", () => {
    expect(runGate(null, 0, true)).toEqual({ disabled: true, title: "Save a version first" });
  });

  it("keeps a saved version with issues from running, naming the version and the count", () => {
    expect(runGate(3, 2, false)).toEqual({ disabled: true, title: "v3 has 2 issues: fix and save to run it" });
    expect(runGate(1, 1, true)).toEqual({ disabled: true, title: "v1 has 1 issue: fix and save to run it" });
  });

  it("runs a valid saved version, saying so when the editor holds unsaved edits", () => {
    expect(runGate(4, 0, false)).toEqual({ disabled: false, title: undefined });
    expect(runGate(4, 0, true)).toEqual({ disabled: false, title: "Runs the saved version v4" });
  });
});
