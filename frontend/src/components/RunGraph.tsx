/** A version's graph, read-only, painted with its nodes' run states. */
import { Background, BackgroundVariant, Controls, ReactFlow, ReactFlowProvider, useNodesState } from "@xyflow/react";
import { useEffect, useMemo } from "react";
import type { EditorLayout, GraphSpec } from "../api/types";
import { type NodeRunView, type SpecEdge, type SpecNode, specToDoc } from "../graph/model";
import { nodeTypes } from "./SpecNodeView";

export function RunGraph({
  spec,
  layout,
  states,
  onSelect,
  selected,
}: {
  spec: GraphSpec;
  layout?: EditorLayout;
  states?: Record<string, NodeRunView>;
  onSelect?: (node: string | null) => void;
  selected?: string | null;
}) {
  const base = useMemo(() => specToDoc(spec, layout ? { nodes: layout.nodes } : {}), [spec, layout]);
  // Controlled nodes keep what React Flow measured: run states update the nodes many times
  // a second, and a node object rebuilt without its size would be hidden until re-measured.
  const [nodes, setNodes, onNodesChange] = useNodesState<SpecNode>(base.nodes);
  useEffect(() => {
    setNodes((current) => {
      const measured = new Map(current.map((n) => [n.id, n.measured]));
      return base.nodes.map((n) => ({
        ...n,
        measured: measured.get(n.id) ?? n.measured,
        selected: n.id === selected,
        data: states ? { ...n.data, run: states[n.id] ?? { state: "pending" } } : n.data,
      }));
    });
  }, [base, states, selected, setNodes]);
  const edges: SpecEdge[] = useMemo(
    () =>
      base.edges.map((e) => {
        const from = states?.[e.source]?.state;
        const className = from === "done" ? "edge-delivered" : from === "running" ? "edge-active" : undefined;
        return { ...e, className, animated: from === "running" || e.animated };
      }),
    [base, states],
  );
  return (
    <ReactFlowProvider>
      <ReactFlow<SpecNode, SpecEdge>
        nodes={nodes}
        edges={edges}
        nodeTypes={nodeTypes}
        onNodesChange={onNodesChange}
        nodesDraggable={false}
        nodesConnectable={false}
        edgesFocusable={false}
        deleteKeyCode={null}
        fitView
        fitViewOptions={{ padding: 0.1, maxZoom: 1.1 }}
        minZoom={0.2}
        proOptions={{ hideAttribution: true }}
        onNodeClick={(_, n) => onSelect?.(n.id)}
        onPaneClick={() => onSelect?.(null)}
      >
        <Background variant={BackgroundVariant.Dots} gap={18} size={1.2} color="#d5dae2" />
        <Controls showInteractive={false} />
      </ReactFlow>
    </ReactFlowProvider>
  );
}
