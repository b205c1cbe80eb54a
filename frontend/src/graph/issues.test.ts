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

describe("an edge's type mismatch", () => {
  const wired: GraphSpec = {
    ...spec,
    nodes: [{ id: "q", kind: "input", outputs: { value: { type: "json" } } }, ...spec.nodes],
    edges: [{ source: "q", source_port: "value", target: "gen", target_port: "prompt" }],
  };
  const mismatch = {
    code: "type_mismatch",
    message: "edge q.value->gen.prompt: output q.value is json but input gen.prompt expects text",
    edge: "q.value->gen.prompt",
    node: "gen",
    port: "prompt",
  };

  it("shows on the edge, the node it feeds and the node it comes from", () => {
    const doc = specToDoc(wired);
    const placed = placeIssues([mismatch], doc);
    expect(placed.byEdge.get("q.value->gen.prompt")).toEqual([mismatch]);
    expect(placed.byNode.get("gen")).toEqual([mismatch]);
    expect(placed.byNode.get("q")).toEqual([mismatch]);
    expect(placed.general).toEqual([]);
  });

  it("other edge issues stay on the node they name", () => {
    const doc = specToDoc(wired);
    const placed = placeIssues([{ ...mismatch, code: "stream_needs_join", message: "edge: subscribe in stream mode" }], doc);
    expect(placed.byNode.get("gen")!.map((i) => i.code)).toEqual(["stream_needs_join"]);
    expect(placed.byNode.has("q")).toBe(false);
  });
});
