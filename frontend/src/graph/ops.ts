/**
 * Edits of an editor document. Each returns a new document (the input is never
 * modified), so undo/redo can keep the old one.
 */
import type { Connection } from "@xyflow/react";
import type { NodeKind, NodeSpec, OpInfo, PortSpec, PortType, RoleSpec } from "../api/types";
import { IDENT } from "../api/types";
import { edgeId } from "./canonical";
import { type EditorDoc, type SpecEdge, type SpecNode, flowEdge, flowNode } from "./model";

export type Catalogue = Map<string, NodeKind>;

/** Whether an output of type `source` may feed an input of type `target` (the validator's rule). */
export const compatible = (source: PortType, target: PortType): boolean =>
  source === target || source === "any" || target === "any";

/** `base`, or `base_2`, `base_3`… whichever is not in `taken`. */
export function uniqueName(base: string, taken: Iterable<string>): string {
  const used = new Set(taken);
  const stem = IDENT.test(base) ? base : `n_${base.replace(/[^A-Za-z0-9_-]/g, "_")}`;
  if (!used.has(stem)) return stem;
  for (let i = 2; ; i++) if (!used.has(`${stem}_${i}`)) return `${stem}_${i}`;
}

function fixedPorts(ports: NodeKind["inputs"]): Record<string, PortSpec> | undefined {
  if (!ports) return undefined;
  const out: Record<string, PortSpec> = {};
  for (const [name, p] of Object.entries(ports)) out[name] = p.optional ? { type: p.type, optional: true } : { type: p.type };
  return out;
}

/**
 * A new node of `kind`: fixed ports from the catalogue; a node that declares its own
 * ports (`python`) starts with one `x` input and one `out` output of type json. A kind
 * that runs on a role gets the first role of a fitting kind, created when there is none.
 */
export function addNode(
  doc: EditorDoc,
  kind: NodeKind,
  position: { x: number; y: number },
): { doc: EditorDoc; id: string } {
  const id = uniqueName(kind.name, doc.nodes.map((n) => n.id));
  const spec: NodeSpec = { id, kind: kind.name };
  spec.inputs = fixedPorts(kind.inputs) ?? { x: { type: "json" } };
  spec.outputs = fixedPorts(kind.outputs) ?? { out: { type: "json" } };
  // A workflow input asks the run form for text until it says otherwise (or its first edge does: `connect`).
  if (kind.name === INPUT_KIND && spec.outputs.value?.type === "any") spec.outputs = { ...spec.outputs, value: { type: "text" } };
  if (kind.op === "required") spec.op = "";
  let roles = doc.roles;
  if (kind.role_kinds.length > 0) {
    let role = roles.find((r) => kind.role_kinds.includes(r.kind));
    if (!role) {
      const roleKind = kind.role_kinds[0];
      role = { name: uniqueName(roleKind, roles.map((r) => r.name)), kind: roleKind };
      roles = [...roles, role];
    }
    spec.role = role.name;
  }
  return { doc: { ...doc, roles, nodes: [...doc.nodes, flowNode(spec, position)] }, id };
}

/** The node kind of a workflow input: its one output `value` is what a run is given under its id. */
export const INPUT_KIND = "input";

/** The types a workflow input may ask a run for (a KV cache is no value a user gives). */
export const INPUT_TYPES: PortType[] = ["text", "image", "audio", "json", "tokens", "tensor", "any"];

/**
 * `doc` with input `source` taking the type of the port it is about to feed, where that edge is its
 * first and the input still has the type it was made with (text, or a loaded spec's any): a new
 * input drawn to an image port asks the run form for an image. An input that feeds something
 * already, one given another type on purpose (image, json ...), or a target that takes any type
 * leaves the type as it is.
 */
function typedByFirstEdge(doc: EditorDoc, conn: Connection): EditorDoc {
  const source = doc.nodes.find((n) => n.id === conn.source)?.data.spec;
  const target = portOf(doc, conn.target, "inputs", conn.targetHandle);
  const value = source?.outputs?.value;
  if (source?.kind !== INPUT_KIND || conn.sourceHandle !== "value" || !value || !target) return doc;
  if (value.type !== "text" && value.type !== "any") return doc;
  if (target.type === "any" || target.type === "kv" || target.type === value.type) return doc;
  if (doc.edges.some((e) => e.source === source.id)) return doc;
  const spec: NodeSpec = { ...source, outputs: { ...source.outputs, value: { ...value, type: target.type } } };
  return { ...doc, nodes: doc.nodes.map((n) => (n.id === source.id ? { ...n, data: { ...n.data, spec } } : n)) };
}

export type ConnectCheck = { ok: true } | { ok: false; hint: string };

function portOf(doc: EditorDoc, node: string, direction: "inputs" | "outputs", port: string | null | undefined) {
  const n = doc.nodes.find((x) => x.id === node);
  if (!n || !port) return undefined;
  return n.data.spec[direction]?.[port];
}

/**
 * Whether `conn` may be added, and why not (a hint for the user) when it may not; an input's first
 * edge may retype it (`typedByFirstEdge`), so its type matches whatever it is drawn to.
 */
export function checkConnection(doc: EditorDoc, conn: Connection): ConnectCheck {
  return checkTyped(typedByFirstEdge(doc, conn), conn);
}

function checkTyped(doc: EditorDoc, conn: Connection): ConnectCheck {
  const out = portOf(doc, conn.source, "outputs", conn.sourceHandle);
  const inp = portOf(doc, conn.target, "inputs", conn.targetHandle);
  if (!out || !inp) return { ok: false, hint: "Connect an output port (right) to an input port (left)." };
  if (conn.source === conn.target) {
    return { ok: false, hint: "A node cannot feed itself; loop through another node with max_iterations set." };
  }
  const id = edgeId({
    source: conn.source,
    source_port: conn.sourceHandle!,
    target: conn.target,
    target_port: conn.targetHandle!,
  });
  if (doc.edges.some((e) => e.id === id)) return { ok: false, hint: "These ports are already connected." };
  if (!compatible(out.type, inp.type)) {
    return {
      ok: false,
      hint:
        `Type mismatch: ${conn.source}.${conn.sourceHandle} is ${out.type} but ` +
        `${conn.target}.${conn.targetHandle} expects ${inp.type}. Ports connect when their types ` +
        `match or one of them is "any".`,
    };
  }
  return { ok: true };
}

export function connect(given: EditorDoc, conn: Connection): { doc: EditorDoc } | { hint: string } {
  const doc = typedByFirstEdge(given, conn);
  const check = checkTyped(doc, conn);
  if (!check.ok) return { hint: check.hint };
  const edge = flowEdge({
    source: conn.source,
    source_port: conn.sourceHandle!,
    target: conn.target,
    target_port: conn.targetHandle!,
  });
  return { doc: { ...doc, edges: [...doc.edges, edge] } };
}

function mapSpec(doc: EditorDoc, f: (spec: NodeSpec) => NodeSpec): SpecNode[] {
  return doc.nodes.map((n) => {
    const spec = f(n.data.spec);
    return spec === n.data.spec ? n : { ...n, data: { ...n.data, spec } };
  });
}

/**
 * Drop trigger members that are no longer predecessors and routes that are no longer
 * successors (after a node or edge was removed); a trigger left with no group is unset.
 */
export function pruneReferences(doc: EditorDoc): EditorDoc {
  const preds = new Map<string, Set<string>>();
  const succs = new Map<string, Set<string>>();
  for (const e of doc.edges) {
    if (!preds.has(e.target)) preds.set(e.target, new Set());
    preds.get(e.target)!.add(e.source);
    if (!succs.has(e.source)) succs.set(e.source, new Set());
    succs.get(e.source)!.add(e.target);
  }
  const nodes = mapSpec(doc, (spec) => {
    let next = spec;
    if (spec.trigger) {
      const p = preds.get(spec.id) ?? new Set();
      const groups = spec.trigger.map((g) => g.filter((m) => p.has(m))).filter((g) => g.length > 0);
      const same = groups.length === spec.trigger.length && groups.every((g, i) => g.length === spec.trigger![i].length);
      if (!same) next = { ...next, trigger: groups.length ? groups : null };
    }
    if (spec.routes) {
      const s = succs.get(spec.id) ?? new Set();
      const routes = spec.routes.filter((r) => s.has(r));
      if (routes.length !== spec.routes.length) next = { ...next, routes };
    }
    return next;
  });
  return { ...doc, nodes };
}

export function removeElements(doc: EditorDoc, nodeIds: Iterable<string>, edgeIds: Iterable<string>): EditorDoc {
  const gone = new Set(nodeIds);
  const cut = new Set(edgeIds);
  const nodes = doc.nodes.filter((n) => !gone.has(n.id));
  const edges = doc.edges.filter((e) => !cut.has(e.id) && !gone.has(e.source) && !gone.has(e.target));
  return pruneReferences({ ...doc, nodes, edges });
}

/** Rename a node, following the rename in edges, triggers and routes. */
export function renameNode(doc: EditorDoc, from: string, to: string): EditorDoc {
  if (from === to) return doc;
  if (!IDENT.test(to)) throw new Error(`"${to}" is not an identifier (a letter or _, then letters, digits, _ or -)`);
  if (doc.nodes.some((n) => n.id === to)) throw new Error(`a node "${to}" already exists`);
  const swap = (id: string) => (id === from ? to : id);
  const nodes = doc.nodes.map((n) => {
    const s = n.data.spec;
    const spec: NodeSpec = {
      ...s,
      id: swap(s.id),
      trigger: s.trigger ? s.trigger.map((g) => g.map(swap)) : s.trigger,
      routes: s.routes ? s.routes.map(swap) : s.routes,
    };
    return { ...n, id: swap(n.id), data: { ...n.data, spec } };
  });
  const edges: SpecEdge[] = doc.edges.map((e) => {
    if (e.source !== from && e.target !== from) return e;
    return flowEdge({
      source: swap(e.source),
      source_port: e.sourceHandle!,
      target: swap(e.target),
      target_port: e.targetHandle!,
      stream: e.data?.stream ?? false,
    });
  });
  return { ...doc, nodes, edges };
}

export function updateNodeSpec(doc: EditorDoc, id: string, patch: Partial<NodeSpec>): EditorDoc {
  return { ...doc, nodes: mapSpec(doc, (s) => (s.id === id ? { ...s, ...patch } : s)) };
}

/**
 * Replace a node's ports in one direction. Edges on ports that disappear are removed;
 * edges on a renamed port (`renames`: old name -> new name) follow it.
 */
export function setPorts(
  doc: EditorDoc,
  id: string,
  direction: "inputs" | "outputs",
  ports: Record<string, PortSpec>,
  renames: Record<string, string> = {},
): EditorDoc {
  const handle = direction === "inputs" ? "targetHandle" : "sourceHandle";
  const end = direction === "inputs" ? "target" : "source";
  const edges: SpecEdge[] = [];
  for (const e of doc.edges) {
    if (e[end] !== id) {
      edges.push(e);
      continue;
    }
    const port = renames[e[handle]!] ?? e[handle]!;
    if (!(port in ports)) continue;
    const spec = {
      source: e.source,
      source_port: direction === "outputs" ? port : e.sourceHandle!,
      target: e.target,
      target_port: direction === "inputs" ? port : e.targetHandle!,
      stream: e.data?.stream ?? false,
    };
    edges.push(flowEdge(spec));
  }
  return pruneReferences({ ...updateNodeSpec(doc, id, { [direction]: ports }), edges });
}

export function setEdgeStream(doc: EditorDoc, id: string, stream: boolean): EditorDoc {
  return {
    ...doc,
    edges: doc.edges.map((e) => (e.id === id ? { ...e, data: { ...e.data, stream }, animated: stream } : e)),
  };
}

export function predecessors(doc: EditorDoc, id: string): string[] {
  return [...new Set(doc.edges.filter((e) => e.target === id).map((e) => e.source))];
}

export function successors(doc: EditorDoc, id: string): string[] {
  return [...new Set(doc.edges.filter((e) => e.source === id).map((e) => e.target))];
}

// ---------------------------------------------------------------------------------- roles
export function addRole(doc: EditorDoc, kind: string): { doc: EditorDoc; name: string } {
  const name = uniqueName(kind, doc.roles.map((r) => r.name));
  return { doc: { ...doc, roles: [...doc.roles, { name, kind }] }, name };
}

/** Change a role; a rename follows into the nodes that run on it. */
export function updateRole(doc: EditorDoc, name: string, next: RoleSpec): EditorDoc {
  if (next.name !== name) {
    if (!IDENT.test(next.name)) throw new Error(`"${next.name}" is not an identifier`);
    if (doc.roles.some((r) => r.name === next.name)) throw new Error(`a role "${next.name}" already exists`);
  }
  const roles = doc.roles.map((r) => (r.name === name ? next : r));
  const nodes = next.name === name ? doc.nodes : mapSpec(doc, (s) => (s.role === name ? { ...s, role: next.name } : s));
  return { ...doc, roles, nodes };
}

export function removeRole(doc: EditorDoc, name: string): EditorDoc {
  return { ...doc, roles: doc.roles.filter((r) => r.name !== name) };
}

/**
 * Make a python node call the registered `op`: its ports become the op's declared ones
 * (edges on ports that remain stay; the others go), its params the op's defaults over the
 * values it already had for the op's params, and it streams when the op is a generator.
 */
export function applyOp(doc: EditorDoc, id: string, op: OpInfo): EditorDoc {
  const node = doc.nodes.find((n) => n.id === id);
  if (!node) return doc;
  const ports = (declared: OpInfo["inputs"]): Record<string, PortSpec> => {
    const out: Record<string, PortSpec> = {};
    for (const [name, p] of Object.entries(declared)) {
      const port: PortSpec = { type: p.type };
      if (p.optional) port.optional = true;
      if (p.join) port.join = p.join;
      out[name] = port;
    }
    return out;
  };
  const properties = op.params_schema.properties ?? {};
  const old = node.data.spec.params ?? {};
  const params: Record<string, unknown> = {};
  for (const [name, schema] of Object.entries(properties)) {
    if (name in old) params[name] = old[name];
    else if (schema.default !== undefined) params[name] = schema.default;
  }
  // A node with one port on a side, given an op with one port there under another name (a fresh
  // python node's `x` -> `out`, connected before its op was chosen), keeps that port's edges on it.
  const carried = (now: Record<string, PortSpec> | undefined, declared: OpInfo["inputs"]): Record<string, string> => {
    const [before, after] = [Object.keys(now ?? {}), Object.keys(declared)];
    return before.length === 1 && after.length === 1 ? { [before[0]]: after[0] } : {};
  };
  let next = setPorts(doc, id, "inputs", ports(op.inputs), carried(node.data.spec.inputs, op.inputs));
  next = setPorts(next, id, "outputs", ports(op.outputs), carried(node.data.spec.outputs, op.outputs));
  const stream = op.stream || undefined;
  return updateNodeSpec(next, id, { op: op.name, params, stream, ...(stream ? { routes: null } : {}) });
}
