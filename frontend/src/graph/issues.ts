/** Validation issues placed on the nodes, ports and edges they name. */
import type { Issue } from "../api/types";
import type { EditorDoc, SpecEdge, SpecNode } from "./model";

export interface PlacedIssues {
  byNode: Map<string, Issue[]>;
  byEdge: Map<string, Issue[]>;
  byRole: Map<string, Issue[]>;
  /** Issues that name nothing the canvas shows (the workflow as a whole). */
  general: Issue[];
}

export function placeIssues(issues: Issue[], doc: EditorDoc): PlacedIssues {
  const nodes = new Set(doc.nodes.map((n) => n.id));
  const edges = new Set(doc.edges.map((e) => e.id));
  const roles = new Set(doc.roles.map((r) => r.name));
  const placed: PlacedIssues = { byNode: new Map(), byEdge: new Map(), byRole: new Map(), general: [] };
  const add = (map: Map<string, Issue[]>, key: string, issue: Issue) => {
    if (!map.has(key)) map.set(key, []);
    map.get(key)!.push(issue);
  };
  for (const issue of issues) {
    let shown = false;
    if (issue.node && nodes.has(issue.node)) {
      add(placed.byNode, issue.node, issue);
      shown = true;
    }
    if (issue.edge && edges.has(issue.edge)) {
      add(placed.byEdge, issue.edge, issue);
      shown = true;
      // A type mismatch is as much its source's as its target's: an input retyped to what the port
      // it feeds does not take is flagged where the user retyped it.
      const source = typeMismatchSource(issue, doc);
      if (source && source !== issue.node) add(placed.byNode, source, issue);
    }
    if (issue.role && roles.has(issue.role)) {
      add(placed.byRole, issue.role, issue);
      shown = shown || !issue.node;
    }
    if (!shown) placed.general.push(issue);
  }
  return placed;
}

/** The node an edge's `type_mismatch` issue comes from (the edge's source), or null. */
function typeMismatchSource(issue: Issue, doc: EditorDoc): string | null {
  if (issue.code !== "type_mismatch" || !issue.edge) return null;
  return doc.edges.find((e) => e.id === issue.edge)?.source ?? null;
}

/** The document with each node's and edge's issues in its data (for rendering). */
export function withIssues(doc: EditorDoc, placed: PlacedIssues): { nodes: SpecNode[]; edges: SpecEdge[] } {
  const nodes = doc.nodes.map((n) => {
    const issues = placed.byNode.get(n.id);
    const roleIssues = n.data.spec.role ? placed.byRole.get(n.data.spec.role) : undefined;
    if (!issues && !n.data.issues && !roleIssues && !n.data.roleIssues) return n;
    return { ...n, data: { ...n.data, issues, roleIssues } };
  });
  const edges = doc.edges.map((e) => {
    const issues = placed.byEdge.get(e.id);
    if (!issues) return e;
    return { ...e, data: { stream: e.data?.stream ?? false, issues }, className: "edge-invalid" };
  });
  return { nodes, edges };
}

/** Names of the ports that issues point at (an issue names a port, not its direction). */
export function issuePorts(issues: Issue[] | undefined): Set<string> {
  return new Set((issues ?? []).flatMap((i) => (i.port ? [i.port] : [])));
}
