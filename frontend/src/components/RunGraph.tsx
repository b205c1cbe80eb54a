/**
 * A version's graph, read-only, painted with its nodes' run states. It opens as the editor does
 * (`useReadableFit`): whole when its titles stay legible, else its inputs with a minimap for the rest.
 */
import { Background, BackgroundVariant, ReactFlow, ReactFlowProvider, useNodesState } from "@xyflow/react";
import { useEffect, useMemo, useRef } from "react";
import type { EditorLayout, GraphSpec } from "../api/types";
import { type NodeRunView, type SpecEdge, type SpecNode, specToDoc } from "../graph/model";
import { useReadableFit } from "../hooks/useReadableFit";
import { FlowControls } from "./FlowControls";
import { FlowMiniMap } from "./FlowMiniMap";
import { nodeTypes } from "./SpecNodeView";

interface RunGraphProps {
  spec: GraphSpec;
  layout?: EditorLayout;
  states?: Record<string, NodeRunView>;
  onSelect?: (node: string | null) => void;
  selected?: string | null;
}

export function RunGraph(props: RunGraphProps) {
  return (
    <ReactFlowProvider>
      <RunGraphView {...props} />
    </ReactFlowProvider>
  );
}

function RunGraphView({ spec, layout, states, onSelect, selected }: RunGraphProps) {
  const canvas = useRef<HTMLDivElement>(null);
  const { fit, whole } = useReadableFit(canvas, true, "when-partial");
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
    <div ref={canvas} className="run-graph-canvas" data-testid="run-graph-canvas">
      <ReactFlow<SpecNode, SpecEdge>
        nodes={nodes}
        edges={edges}
        nodeTypes={nodeTypes}
        onNodesChange={onNodesChange}
        nodesDraggable={false}
        nodesConnectable={false}
        edgesFocusable={false}
        deleteKeyCode={null}
        minZoom={0.2}
        proOptions={{ hideAttribution: true }}
        onNodeClick={(_, n) => onSelect?.(n.id)}
        onPaneClick={() => onSelect?.(null)}
      >
        <Background variant={BackgroundVariant.Dots} gap={18} size={1.2} color="#d5dae2" />
        <FlowControls onFit={() => fit(300)} />
        {whole === false && <FlowMiniMap nodeColor="#c7d2fe" />}
      </ReactFlow>
    </div>
  );
}
