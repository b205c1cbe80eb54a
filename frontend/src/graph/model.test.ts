import { describe, expect, it } from "vitest";
import type { GraphSpec, Issue, NodeKind } from "../api/types";
import { canonicalSpec, edgeId, jsonEqual } from "./canonical";
import diamond from "./fixtures/diamond.json";
import kitchenSink from "./fixtures/kitchen_sink.json";
import kitchenSinkCanonical from "./fixtures/kitchen_sink.canonical.json";
import loop from "./fixtures/loop.json";
import router from "./fixtures/router.json";
import stream from "./fixtures/stream.json";
import { placeIssues, withIssues } from "./issues";
import { docLayout, docToSpec, emptyDoc, specNameFor, specToDoc } from "./model";
import {
  addNode,
  checkConnection,
  connect,
  removeElements,
  renameNode,
  setPorts,
  updateRole,
  uniqueName,
} from "./ops";

const examples: Record<string, GraphSpec> = {
  diamond: diamond as unknown as GraphSpec,
  loop: loop as unknown as GraphSpec,
  router: router as unknown as GraphSpec,
  stream: stream as unknown as GraphSpec,
};

const kinds: Record<string, NodeKind> = {
  input: {
    name: "input", description: "", category: "io", role_kinds: [], params_schema: {},
    inputs: {}, outputs: { value: { type: "any", optional: false } }, op: "forbidden",
  },
  output: {
    name: "output", description: "", category: "io", role_kinds: [], params_schema: {},
    inputs: { value: { type: "any", optional: false } }, outputs: {}, op: "forbidden",
  },
  python: {
    name: "python", description: "", category: "general", role_kinds: ["python"], params_schema: {},
    inputs: null, outputs: null, op: "required",
  },
  llm: {
    name: "llm", description: "", category: "model", role_kinds: ["llm"], params_schema: {},
    inputs: { prompt: { type: "text", optional: true }, tokens: { type: "tokens", optional: true } },
    outputs: { text: { type: "text", optional: false } }, op: "forbidden",
  },
};

describe("GraphSpec -> editor document -> GraphSpec", () => {
  it.each(Object.entries(examples))("round-trips the %s example exactly", (_, spec) => {
    const doc = specToDoc(spec);
    expect(docToSpec(doc)).toStrictEqual(spec);
  });

  it("round-trips every GraphSpec field to the backend's canonical form", () => {
    const back = docToSpec(specToDoc(kitchenSink as unknown as GraphSpec));
    expect(back).toStrictEqual(kitchenSinkCanonical);
    // The explicit default (`"stream": false` on an edge) is what canonicalisation drops.
    expect(canonicalSpec(kitchenSink as unknown as GraphSpec)).toStrictEqual(kitchenSinkCanonical);
  });

  it("keeps node and edge order (a join: all port gathers in edge order)", () => {
    const doc = specToDoc(examples.diamond);
    expect(doc.nodes.map((n) => n.id)).toEqual(["n", "square", "cube", "memo", "total", "sum"]);
    expect(doc.edges.map((e) => e.id)).toEqual(examples.diamond.edges.map(edgeId));
  });

  it("maps ports to handles and edge ids to the backend's edge ids", () => {
    const doc = specToDoc(examples.stream);
    const e = doc.edges.find((x) => x.source === "words")!;
    expect(e).toMatchObject({
      id: "words.word->shout.words",
      sourceHandle: "word",
      targetHandle: "words",
      data: { stream: true },
      animated: true,
    });
  });

  it("places nodes from the layout and lays out the ones it lacks", () => {
    const doc = specToDoc(examples.diamond, { nodes: { n: { x: 5, y: 7 } } });
    const placed = Object.fromEntries(doc.nodes.map((n) => [n.id, n.position]));
    // One node without a position: the whole graph is laid out left to right.
    expect(placed.n.x).toBeLessThan(placed.square.x);
    expect(placed.square.x).toBeLessThan(placed.total.x);
    expect(placed.total.x).toBeLessThan(placed.sum.x);

    const all = Object.fromEntries(doc.nodes.map((n) => [n.id, { x: n.position.x + 1, y: n.position.y }]));
    const kept = specToDoc(examples.diamond, { nodes: all });
    expect(docLayout(kept).nodes).toEqual(all);
  });

  it("does not share state with the spec it was built from", () => {
    const spec = structuredClone(examples.loop);
    const doc = specToDoc(spec);
    doc.nodes[0].data.spec.params!.default = 99;
    expect(spec.nodes[0].params!.default).toBe(3);
  });
});

describe("editing", () => {
  it("adds nodes with unique ids, catalogue ports and a fitting role", () => {
    let doc = emptyDoc("wf");
    ({ doc } = addNode(doc, kinds.input, { x: 0, y: 0 }));
    ({ doc } = addNode(doc, kinds.python, { x: 200, y: 0 }));
    ({ doc } = addNode(doc, kinds.python, { x: 400, y: 0 }));
    ({ doc } = addNode(doc, kinds.output, { x: 600, y: 0 }));
    expect(doc.nodes.map((n) => n.id)).toEqual(["input", "python", "python_2", "output"]);
    expect(doc.roles).toEqual([{ name: "python", kind: "python" }]);
    const spec = docToSpec(doc);
    expect(spec.nodes[1]).toEqual({
      id: "python", kind: "python", role: "python", op: "",
      inputs: { x: { type: "json" } }, outputs: { out: { type: "json" } },
    });
    // A new input asks a run for text (the catalogue's `any` asks for a JSON value, rarely what is meant).
    expect(spec.nodes[0]).toEqual({ id: "input", kind: "input", outputs: { value: { type: "text" } } });
    expect(spec.nodes[3]).toEqual({ id: "output", kind: "output", inputs: { value: { type: "any" } } });
  });

  it("keeps optional flags of fixed ports", () => {
    const { doc } = addNode(emptyDoc("wf"), kinds.llm, { x: 0, y: 0 });
    expect(docToSpec(doc).nodes[0].inputs).toEqual({
      prompt: { type: "text", optional: true },
      tokens: { type: "tokens", optional: true },
    });
    expect(doc.roles).toEqual([{ name: "llm", kind: "llm" }]);
  });

  it("connects compatible ports and refuses the rest with a hint", () => {
    let doc = specToDoc({
      version: 1, name: "t", roles: [],
      nodes: [
        { id: "a", kind: "input", outputs: { value: { type: "text" } } },
        { id: "b", kind: "python", op: "x", outputs: { value: { type: "image" } } },
        { id: "c", kind: "input", outputs: { value: { type: "any" } } },
        { id: "gen", kind: "llm", inputs: { prompt: { type: "text", optional: true } } },
      ],
      edges: [],
    });
    const to = (source: string) => ({ source, sourceHandle: "value", target: "gen", targetHandle: "prompt" });
    expect(checkConnection(doc, to("a"))).toEqual({ ok: true });
    expect(checkConnection(doc, to("c"))).toEqual({ ok: true });
    const refused = checkConnection(doc, to("b"));
    expect(refused.ok).toBe(false);
    expect(!refused.ok && refused.hint).toMatch(/b\.value is image but gen\.prompt expects text/);

    const result = connect(doc, to("a"));
    expect("doc" in result).toBe(true);
    doc = (result as { doc: typeof doc }).doc;
    expect(docToSpec(doc).edges).toEqual([{ source: "a", source_port: "value", target: "gen", target_port: "prompt" }]);
    expect(connect(doc, to("a"))).toEqual({ hint: "These ports are already connected." });
    expect(connect(doc, { source: "gen", sourceHandle: "x", target: "gen", targetHandle: "prompt" })).toHaveProperty("hint");
  });

  it("types an input by its first edge, and only by its first", () => {
    let doc = specToDoc({
      version: 1, name: "t", roles: [],
      nodes: [
        { id: "picture", kind: "input", outputs: { value: { type: "text" } } },
        { id: "vit", kind: "vision_encode", inputs: { image: { type: "image" } } },
        { id: "gen", kind: "llm", inputs: { prompt: { type: "text", optional: true } } },
        { id: "sink", kind: "output", inputs: { value: { type: "any" } } },
        { id: "kvin", kind: "llm", inputs: { kv: { type: "kv", optional: true } } },
        { id: "clip", kind: "input", outputs: { value: { type: "audio" } } },
      ],
      edges: [],
    });
    const edge = (target: string, targetHandle: string) => ({ source: "picture", sourceHandle: "value", target, targetHandle });
    const typeOf = (d: typeof doc) => docToSpec(d).nodes[0].outputs!.value.type;
    expect(checkConnection(doc, edge("kvin", "kv")).ok).toBe(false); // a KV cache is no value a run is given
    expect(typeOf((connect(doc, edge("sink", "value")) as { doc: typeof doc }).doc)).toBe("text"); // any: kept
    doc = (connect(doc, edge("vit", "image")) as { doc: typeof doc }).doc;
    expect(typeOf(doc)).toBe("image");
    // An input given another type on purpose keeps it: a mismatch to fix, not a reason to retype it.
    expect(checkConnection(doc, { ...edge("vit", "image"), source: "clip" }).ok).toBe(false);
    // It feeds the encoder now: a text port is a mismatch to fix, not a reason to retype it.
    expect(checkConnection(doc, edge("gen", "prompt"))).toEqual({
      ok: false,
      hint: expect.stringMatching(/picture\.value is image but gen\.prompt expects text/),
    });
  });

  it("renames a node through edges, triggers and routes", () => {
    const doc = renameNode(specToDoc(examples.diamond), "memo", "lookup");
    const spec = docToSpec(doc);
    expect(spec.nodes.find((n) => n.id === "total")!.trigger).toEqual([["square", "cube"], ["lookup"]]);
    expect(spec.nodes.find((n) => n.id === "lookup")!.routes).toEqual(["total"]);
    expect(spec.edges.filter((e) => e.source === "lookup" || e.target === "lookup").map(edgeId)).toEqual([
      "n.value->lookup.x",
      "lookup.out->total.values",
    ]);
    expect(() => renameNode(doc, "lookup", "square")).toThrow(/already exists/);
    expect(() => renameNode(doc, "lookup", "9lives")).toThrow(/identifier/);
  });

  it("removes a node with its edges and prunes triggers and routes that named it", () => {
    const doc = removeElements(specToDoc(examples.diamond), ["memo"], []);
    const spec = docToSpec(doc);
    expect(spec.nodes.map((n) => n.id)).toEqual(["n", "square", "cube", "total", "sum"]);
    expect(spec.edges.some((e) => e.source === "memo" || e.target === "memo")).toBe(false);
    expect(spec.nodes.find((n) => n.id === "total")!.trigger).toEqual([["square", "cube"]]);
  });

  it("removing an edge drops its route and an emptied trigger", () => {
    const doc = removeElements(specToDoc(examples.router), [], ["classify.out->echo.text"]);
    const spec = docToSpec(doc);
    expect(spec.nodes.find((n) => n.id === "classify")!.routes).toEqual(["answer"]);
    const spec2 = docToSpec(removeElements(specToDoc(examples.diamond), [], ["memo.out->total.values"]));
    expect(spec2.nodes.find((n) => n.id === "total")!.trigger).toEqual([["square", "cube"]]);
  });

  it("renames and removes ports, carrying or cutting their edges", () => {
    const doc = specToDoc(examples.diamond);
    const renamed = setPorts(doc, "total", "inputs", { vals: { type: "json", join: "all" } }, { values: "vals" });
    expect(docToSpec(renamed).edges.filter((e) => e.target === "total").map((e) => e.target_port)).toEqual([
      "vals", "vals", "vals",
    ]);
    const cut = setPorts(doc, "n", "outputs", {});
    const spec = docToSpec(cut);
    expect(spec.edges.some((e) => e.source === "n")).toBe(false);
  });

  it("renames a role in the nodes that run on it", () => {
    const doc = updateRole(specToDoc(examples.diamond), "py", { name: "workers", kind: "python", replicas: 2 });
    const spec = docToSpec(doc);
    expect(spec.roles).toEqual([{ name: "workers", kind: "python", replicas: 2 }]);
    expect(spec.nodes.filter((n) => n.kind === "python").every((n) => n.role === "workers")).toBe(true);
  });

  it("keeps a role's tp_size through doc <-> spec and drops the default", () => {
    const spec: GraphSpec = {
      version: 1, name: "tp", roles: [{ name: "lm", kind: "llm", model: "tiny-llama", tp_size: 2 }], nodes: [], edges: [],
    };
    const back = docToSpec(specToDoc(spec));
    expect(back.roles).toEqual([{ name: "lm", kind: "llm", model: "tiny-llama", tp_size: 2 }]);
    const single = updateRole(specToDoc(spec), "lm", { ...spec.roles[0], tp_size: 1 });
    expect(docToSpec(single).roles).toEqual([{ name: "lm", kind: "llm", model: "tiny-llama" }]);
    const four = updateRole(specToDoc(spec), "lm", { ...spec.roles[0], tp_size: 4 });
    expect(docToSpec(four).roles[0].tp_size).toBe(4);
  });

  it("names uniquely", () => {
    expect(uniqueName("python", ["python", "python_2"])).toBe("python_3");
    expect(uniqueName("x", [])).toBe("x");
  });
});

describe("spec names", () => {
  it("turn a workflow's name into an identifier", () => {
    expect(specNameFor("caption-images")).toBe("caption-images");
    expect(specNameFor("My pipeline v2!")).toBe("My_pipeline_v2_");
    expect(specNameFor("2nd try")).toBe("_2nd_try");
    expect(specNameFor("x".repeat(80))).toHaveLength(64);
    expect(emptyDoc("a b").name).toBe("a_b");
  });

  it("start a new workflow's draft with the description it was created with", () => {
    const doc = emptyDoc("greet flow", "says hello to a name");
    expect(doc.description).toBe("says hello to a name");
    expect(docToSpec(doc).description).toBe("says hello to a name");
  });
});

describe("validation issues", () => {
  it("land on the node, port, edge and role they name; the rest are general", () => {
    const doc = specToDoc(examples.diamond);
    const issues: Issue[] = [
      { code: "missing_op", message: "node 'square' needs an op", node: "square" },
      { code: "type_mismatch", message: "…", edge: "n.value->cube.x", node: "cube", port: "x" },
      { code: "unknown_policy", message: "…", role: "py" },
      { code: "empty", message: "the workflow has no nodes" },
    ];
    const placed = placeIssues(issues, doc);
    expect(placed.byNode.get("square")!.map((i) => i.code)).toEqual(["missing_op"]);
    expect(placed.byNode.get("cube")!.map((i) => i.port)).toEqual(["x"]);
    expect(placed.byEdge.get("n.value->cube.x")!.length).toBe(1);
    expect(placed.byRole.get("py")!.length).toBe(1);
    expect(placed.general.map((i) => i.code)).toEqual(["empty"]);
    const shown = withIssues(doc, placed);
    expect(shown.nodes.find((n) => n.id === "square")!.data.issues).toHaveLength(1);
    expect(shown.edges.find((e) => e.id === "n.value->cube.x")!.className).toBe("edge-invalid");
  });
});

describe("op issues", () => {
  it("an unknown or refused op lands on its node, as the studio's validation names it", () => {
    const doc = specToDoc(examples.diamond);
    const issues: Issue[] = [
      { code: "op_unknown", message: "node 'square': op 'diamond.sqare' is not a registered op", node: "square" },
      { code: "op_not_allowed", message: "node 'cube': op 'os:system' names code by its module path", node: "cube" },
    ];
    const shown = withIssues(doc, placeIssues(issues, doc));
    expect(shown.nodes.find((n) => n.id === "square")!.data.issues!.map((i) => i.code)).toEqual(["op_unknown"]);
    expect(shown.nodes.find((n) => n.id === "cube")!.data.issues!.map((i) => i.code)).toEqual(["op_not_allowed"]);
  });
});

describe("jsonEqual", () => {
  it("ignores key order only", () => {
    expect(jsonEqual({ a: 1, b: [1, { c: 2 }] }, { b: [1, { c: 2 }], a: 1 })).toBe(true);
    expect(jsonEqual({ a: 1 }, { a: 1, b: undefined })).toBe(false);
    expect(jsonEqual([1, 2], [2, 1])).toBe(false);
  });
});
