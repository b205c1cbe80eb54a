/**
 * Canonical GraphSpec documents, as the backend encodes them: defaults omitted
 * (msgspec `omit_defaults`), fields in declaration order. Two equal workflows give
 * deep-equal documents, so the editor can tell "unchanged" without asking the server.
 */
import type { EdgeSpec, GraphSpec, NodeSpec, PortSpec, RoleSpec } from "../api/types";

const isEmptyObject = (v: unknown): boolean =>
  v !== null && typeof v === "object" && !Array.isArray(v) && Object.keys(v as object).length === 0;

/** Copy `fields` of `source` in order, leaving out those equal to their default. */
function pick<T extends object>(source: T, fields: [keyof T, unknown][]): T {
  const out: Record<string, unknown> = {};
  for (const [field, fallback] of fields) {
    const value = source[field];
    if (value === undefined) continue;
    if (value === fallback) continue;
    if (fallback === EMPTY && isEmptyObject(value)) continue;
    out[field as string] = value;
  }
  return out as T;
}

/** Marks a field whose default is an empty object. */
const EMPTY = Symbol("empty object");

export function canonicalPort(port: PortSpec): PortSpec {
  return pick(port, [
    ["type", undefined],
    ["optional", false],
    ["join", null],
    ["description", ""],
  ]);
}

function canonicalPorts(ports: Record<string, PortSpec> | undefined): Record<string, PortSpec> | undefined {
  if (!ports) return undefined;
  const out: Record<string, PortSpec> = {};
  for (const [name, port] of Object.entries(ports)) out[name] = canonicalPort(port);
  return out;
}

export function canonicalRole(role: RoleSpec): RoleSpec {
  return pick(role, [
    ["name", undefined],
    ["kind", undefined],
    ["model", null],
    ["replicas", 1],
    ["tp_size", 1],
    ["device", "cpu"],
    ["balance", "round_robin"],
    ["balance_params", EMPTY],
    ["resources", EMPTY],
    ["params", EMPTY],
  ]);
}

export function canonicalNode(node: NodeSpec): NodeSpec {
  return pick(
    { ...node, inputs: canonicalPorts(node.inputs), outputs: canonicalPorts(node.outputs) },
    [
      ["id", undefined],
      ["kind", undefined],
      ["role", null],
      ["op", null],
      ["params", EMPTY],
      ["inputs", EMPTY],
      ["outputs", EMPTY],
      ["trigger", null],
      ["routes", null],
      ["stream", false],
      ["max_iterations", null],
      ["retries", 0],
      ["timeout_s", null],
      ["description", ""],
    ],
  );
}

export function canonicalEdge(edge: EdgeSpec): EdgeSpec {
  return pick(edge, [
    ["source", undefined],
    ["source_port", undefined],
    ["target", undefined],
    ["target_port", undefined],
    ["stream", false],
  ]);
}

export function canonicalSpec(spec: GraphSpec): GraphSpec {
  const out: GraphSpec = {
    version: spec.version,
    name: spec.name,
    roles: spec.roles.map(canonicalRole),
    nodes: spec.nodes.map(canonicalNode),
    edges: spec.edges.map(canonicalEdge),
  };
  if (spec.description) out.description = spec.description;
  if (spec.meta && !isEmptyObject(spec.meta)) out.meta = spec.meta;
  return out;
}

/** The backend's edge id: `source.port->target.port`. */
export const edgeId = (e: EdgeSpec): string => `${e.source}.${e.source_port}->${e.target}.${e.target_port}`;

/** Structural equality of JSON values, ignoring object key order. */
export function jsonEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== typeof b || a === null || b === null || typeof a !== "object") return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  if (Array.isArray(a)) {
    const bb = b as unknown[];
    return a.length === bb.length && a.every((v, i) => jsonEqual(v, bb[i]));
  }
  const ka = Object.keys(a as object);
  const kb = Object.keys(b as object);
  if (ka.length !== kb.length) return false;
  return ka.every((k) => Object.prototype.hasOwnProperty.call(b, k) && jsonEqual((a as never)[k], (b as never)[k]));
}
