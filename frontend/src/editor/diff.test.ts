import { describe, expect, it } from "vitest";
import type { VersionDiff } from "../api/types";
import { CHANGE_MARK, workflowFieldChanges } from "./diff";

const none = { added: [], removed: [], changed: [] };

describe("a version diff's workflow fields", () => {
  it("read as added against nothing (the first version)", () => {
    // `GET /api/workflows/<id>/versions/1/diff/`: version 1 against nothing.
    const first: VersionDiff = {
      workflow: "w", from_version: 0, to_version: 1, roles: none, nodes: { ...none, added: ["a"] }, edges: none,
      unified: "",
      fields: {
        description: { from: null, to: "d", change: "added" },
        name: { from: null, to: "w", change: "added" },
        version: { from: null, to: 1, change: "added" },
      },
    };
    const marks = workflowFieldChanges(first).map(({ name, change }) => `${CHANGE_MARK[change].sign} ${name}`);
    expect(marks).toEqual(["+ description", "+ name", "+ version"]);
  });

  it("say which were removed and which changed", () => {
    const later: VersionDiff = {
      workflow: "w", from_version: 1, to_version: 2, roles: none, nodes: none, edges: none, unified: "",
      fields: {
        description: { from: "d", to: "e", change: "changed" },
        meta: { from: { k: 1 }, to: null, change: "removed" },
      },
    };
    expect(workflowFieldChanges(later).map(({ name, change }) => [name, CHANGE_MARK[change].chip])).toEqual([
      ["description", "chip-changed"],
      ["meta", "chip-removed"],
    ]);
  });
});
