import { describe, expect, it } from "vitest";
import { runGate } from "./runGate";

describe("runGate", () => {
  it("asks for a first save", () => {
    expect(runGate(null, 0, true)).toEqual({ disabled: true, title: "Save a version first", confirm: undefined });
  });

  it("keeps a saved version with issues from running, naming the version and the count", () => {
    expect(runGate(3, 2, false)).toEqual({ disabled: true, title: "v3 has 2 issues: fix and save to run it", confirm: undefined });
    expect(runGate(1, 1, true)).toEqual({ disabled: true, title: "v1 has 1 issue: fix and save to run it", confirm: undefined });
  });

  it("runs a valid saved version at once when nothing is unsaved", () => {
    expect(runGate(4, 0, false)).toEqual({ disabled: false, title: undefined, confirm: undefined });
  });

  it("asks before unsaved edits are left behind, as the Back link does, naming the version that runs", () => {
    expect(runGate(4, 0, true)).toEqual({
      disabled: false,
      title: "Runs the saved version v4",
      confirm: "Leave the editor to run the saved version v4? Your unsaved changes will be lost.",
    });
  });
});
