import { describe, expect, it } from "vitest";
import type { GraphSpec, OpInfo } from "../api/types";
import { docToSpec, specToDoc } from "./model";
import { applyOp } from "./ops";

const spec: GraphSpec = {
  version: 1,
  name: "w",
  roles: [{ name: "py", kind: "python" }],
  nodes: [
    { id: "name", kind: "input", outputs: { value: { type: "text" } } },
    { id: "step", kind: "python", role: "py", op: "", inputs: { x: { type: "json" }, name: { type: "text" } },
      outputs: { out: { type: "json" } }, params: { loud: true, stale: 1 } },
    { id: "greeting", kind: "output", inputs: { value: { type: "any" } } },
  ],
  edges: [
    { source: "name", source_port: "value", target: "step", target_port: "name" },
    { source: "step", source_port: "out", target: "greeting", target_port: "value" },
  ],
};

const greet: OpInfo = {
  name: "hello.greet",
  description: "A greeting for `name`.",
  inputs: { name: { type: "text", optional: false } },
  outputs: { out: { type: "text", optional: false } },
  params_schema: { type: "object", properties: { punctuation: { type: "string", default: "!" }, loud: { type: "boolean" } } },
  stream: false,
  output_dirs: [],
};

describe("choosing an op", () => {
  it("gives the node the op's ports and params, keeping the edges that still fit", () => {
    const out = docToSpec(applyOp(specToDoc(spec), "step", greet));
    const step = out.nodes.find((n) => n.id === "step")!;
    expect(step.op).toBe("hello.greet");
    expect(step.inputs).toEqual({ name: { type: "text" } });
    expect(step.outputs).toEqual({ out: { type: "text" } });
    expect(step.params).toEqual({ punctuation: "!", loud: true });
    expect(out.edges.map((e) => `${e.source}.${e.source_port}->${e.target}.${e.target_port}`)).toEqual([
      "name.value->step.name",
      "step.out->greeting.value",
    ]);
  });

  it("drops edges on ports the op does not have, and streams for a generator", () => {
    const spell: OpInfo = { ...greet, name: "stream.spell", inputs: { text: { type: "text", optional: false, join: "all" } }, stream: true };
    const out = docToSpec(applyOp(specToDoc(spec), "step", spell));
    const step = out.nodes.find((n) => n.id === "step")!;
    expect(step.inputs).toEqual({ text: { type: "text", join: "all" } });
    expect(step.stream).toBe(true);
    expect(out.edges.map((e) => e.target_port)).toEqual(["value"]);
  });

  it("keeps the edges of a node's one input and one output on the op's one input and output", () => {
    // A fresh python node (`x` -> `out`), connected before its op is chosen.
    const fresh: GraphSpec = {
      ...spec,
      nodes: spec.nodes.map((n) => (n.id === "step" ? { ...n, inputs: { x: { type: "any" } }, outputs: { out: { type: "any" } } } : n)),
      edges: [
        { source: "name", source_port: "value", target: "step", target_port: "x" },
        { source: "step", source_port: "out", target: "greeting", target_port: "value" },
      ],
    };
    const join: OpInfo = { ...greet, name: "chat.join_text", inputs: { parts: { type: "text", optional: false, join: "ordered" } },
                           outputs: { text: { type: "text", optional: false } } };
    const out = docToSpec(applyOp(specToDoc(fresh), "step", join));
    expect(out.edges.map((e) => `${e.source}.${e.source_port}->${e.target}.${e.target_port}`)).toEqual([
      "name.value->step.parts",
      "step.text->greeting.value",
    ]);
  });
});
