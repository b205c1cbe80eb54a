/**
 * The editor's document and its conversion to and from GraphSpec.
 *
 * A React Flow node carries its GraphSpec node in `data.spec` (with `node.id ===
 * data.spec.id`); handles are named after ports (`sourceHandle` = output port,
 * `targetHandle` = input port), and an edge's id is the backend's edge id, so
 * validation issues map straight onto nodes, ports and edges. Node and edge order is
 * the spec's order: it matters (a `join: all` port gathers in edge order).
 *
 * `specToDoc` and `docToSpec` are inverse: `docToSpec(specToDoc(s))` equals the
 * canonical form of `s` (tested against the backend's canonical documents).
 */
import type { Edge, Node } from "@xyflow/react";
import type { EdgeSpec, EditorLayout, GraphSpec, Issue, NodeSpec, NodeState, RoleSpec } from "../api/types";
import { canonicalSpec, edgeId } from "./canonical";
import { autoLayout } from "./layout";

/** What the run view paints onto a node. */
export interface NodeRunView {
  state: NodeState;
  durationMs?: number | null;
  progress?: number | null;
  message?: string;
  error?: string | null;
  iterations?: number;
  /** Where its latest attempt ran. */
  worker?: string | null;
  host?: string | null;
}

export type SpecNodeData = {
  spec: NodeSpec;
  issues?: Issue[];
  /** Issues of the role the node runs on (a role without a model…): shown on the node too. */
  roleIssues?: Issue[];
  run?: NodeRunView;
};
export type SpecNode = Node<SpecNodeData, "spec">;
export type SpecEdgeData = { stream: boolean; issues?: Issue[] };
export type SpecEdge = Edge<SpecEdgeData>;

export interface EditorDoc {
  name: string;
  description: string;
  meta: Record<string, unknown>;
  roles: RoleSpec[];
  nodes: SpecNode[];
  edges: SpecEdge[];
}

/**
 * The first draft of a workflow with no saved version: its name as the spec's, and `description`
 * (what the New workflow dialog was given, kept on the workflow) as the spec's description, so the
 * editor's Description shows it and the first save keeps it.
 */
export function emptyDoc(name: string, description = ""): EditorDoc {
  return { name: specNameFor(name), description, meta: {}, roles: [], nodes: [], edges: [] };
}

/** A GraphSpec name (an identifier of at most 64 characters) for a workflow's name. */
export function specNameFor(name: string): string {
  const cleaned = name.replace(/[^A-Za-z0-9_-]+/g, "_").slice(0, 64);
  return /^[A-Za-z_]/.test(cleaned) ? cleaned : `_${cleaned}`.slice(0, 64);
}

export function flowNode(spec: NodeSpec, position: { x: number; y: number }): SpecNode {
  return { id: spec.id, type: "spec", position, data: { spec } };
}

export function flowEdge(spec: EdgeSpec): SpecEdge {
  return {
    id: edgeId(spec),
    source: spec.source,
    sourceHandle: spec.source_port,
    target: spec.target,
    targetHandle: spec.target_port,
    data: { stream: spec.stream ?? false },
    animated: spec.stream ?? false,
  };
}

export function edgeSpecOf(edge: SpecEdge): EdgeSpec {
  return {
    source: edge.source,
    source_port: edge.sourceHandle ?? "",
    target: edge.target,
    target_port: edge.targetHandle ?? "",
    stream: edge.data?.stream ?? false,
  };
}

/** An editor document for `spec`, placed by `layout` (auto-laid-out where it says nothing). */
export function specToDoc(spec: GraphSpec, layout: EditorLayout = {}): EditorDoc {
  const placed = layout.nodes ?? {};
  const nodes = spec.nodes.map((n, i) => flowNode(structuredClone(n), placed[n.id] ?? { x: 0, y: i * 120 }));
  const edges = spec.edges.map(flowEdge);
  const missing = spec.nodes.some((n) => !placed[n.id]);
  return {
    name: spec.name,
    description: spec.description ?? "",
    meta: structuredClone(spec.meta ?? {}),
    roles: structuredClone(spec.roles),
    nodes: missing ? autoLayout(nodes, edges) : nodes,
    edges,
  };
}

/** The canonical GraphSpec of an editor document. */
export function docToSpec(doc: EditorDoc): GraphSpec {
  return canonicalSpec({
    version: 1,
    name: doc.name,
    roles: doc.roles,
    nodes: doc.nodes.map((n) => ({ ...n.data.spec, id: n.id })),
    edges: doc.edges.map(edgeSpecOf),
    description: doc.description,
    meta: doc.meta,
  });
}

/** Node positions (rounded) for the version's `layout`. */
export function docLayout(doc: EditorDoc, viewport?: EditorLayout["viewport"]): EditorLayout {
  const nodes: Record<string, { x: number; y: number }> = {};
  for (const n of doc.nodes) nodes[n.id] = { x: Math.round(n.position.x), y: Math.round(n.position.y) };
  return viewport ? { nodes, viewport } : { nodes };
}
