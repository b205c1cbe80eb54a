import { describe, expect, it } from "vitest";
import type { GraphSpec } from "../api/types";
import { placeIssues, withIssues } from "./issues";
import { specToDoc } from "./model";

const spec: GraphSpec = {
  version: 1,
  name: "w",
  roles: [{ name: "lm", kind: "llm" }, { name: "py", kind: "python" }],
  nodes: [
    { id: "gen", kind: "llm", role: "lm", inputs: { prompt: { type: "text" } }, outputs: { text: { type: "text" } } },
    { id: "step", kind: "python", role: "py", op: "x.y", inputs: { x: { type: "json" } }, outputs: { out: { type: "json" } } },
  ],
  edges: [],
};

describe("a role's issues", () => {
  it("show on the nodes that run on it, apart from the nodes' own", () => {
    const doc = specToDoc(spec);
    const placed = placeIssues(
      [
        { code: "model_missing", message: "role 'lm' of kind 'llm' needs a model", role: "lm", path: "model" },
        { code: "op_unknown", message: "node 'step': op 'x.y' is not a registered op", node: "step", path: "op" },
      ],
      doc,
    );
    const nodes = withIssues(doc, placed).nodes;
    const gen = nodes.find((n) => n.id === "gen")!.data;
    const step = nodes.find((n) => n.id === "step")!.data;
    expect(gen.issues).toBeUndefined();
    expect(gen.roleIssues!.map((i) => i.code)).toEqual(["model_missing"]);
    expect(step.issues!.map((i) => i.code)).toEqual(["op_unknown"]);
    expect(step.roleIssues).toBeUndefined();
    expect(placed.general).toEqual([]);
  });
});
