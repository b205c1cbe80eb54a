/** Auto-layout with dagre: left to right, ranks by edges, sizes measured where known. */
import dagre from "@dagrejs/dagre";
import type { Edge, Node } from "@xyflow/react";
import type { NodeSpec } from "../api/types";

/**
 * The width of a node on the canvas (`.spec-node`'s min-width in styles.css): every port row of the
 * built-in kinds fits in it; a node whose op names longer ports is wider.
 */
export const NODE_WIDTH = 230;

/**
 * A node's size: what React Flow measured, else an estimate from what the node shows
 * (header, op line, badges, port rows, and room for the run footer).
 */
function sizeOf(node: Node): { width: number; height: number } {
  if (node.measured?.width && node.measured?.height) {
    return { width: node.measured.width, height: node.measured.height };
  }
  const spec = (node.data as { spec?: NodeSpec }).spec;
  const rows = Math.max(Object.keys(spec?.inputs ?? {}).length, Object.keys(spec?.outputs ?? {}).length);
  const op = spec?.op !== undefined && spec?.op !== null ? 26 : 0;
  const chips = spec?.routes || spec?.stream || spec?.trigger || spec?.max_iterations ? 26 : 0;
  return { width: NODE_WIDTH, height: 52 + op + chips + 10 + rows * 24 + 32 };
}

export function autoLayout<N extends Node>(nodes: N[], edges: Edge[]): N[] {
  const g = new dagre.graphlib.Graph({ multigraph: true });
  g.setGraph({ rankdir: "LR", nodesep: 28, ranksep: 44, marginx: 20, marginy: 20 });
  g.setDefaultEdgeLabel(() => ({}));
  for (const n of nodes) g.setNode(n.id, sizeOf(n));
  for (const e of edges) {
    // A back edge of a loop would pull its target right; dagre's acyclicer handles it.
    if (g.hasNode(e.source) && g.hasNode(e.target)) g.setEdge(e.source, e.target, {}, e.id);
  }
  dagre.layout(g);
  return nodes.map((n) => {
    const p = g.node(n.id);
    const { width, height } = sizeOf(n);
    return { ...n, position: { x: Math.round(p.x - width / 2), y: Math.round(p.y - height / 2) } };
  });
}
