/**
 * The canvas's minimap, small and foldable: it sits in the bottom-right corner over the graph, so
 * it takes little room (a third of React Flow's default area) and a button under it hides it (and
 * brings it back) when it covers nodes there.
 */
import { MiniMap, Panel } from "@xyflow/react";
import { useState } from "react";
import type { SpecNode } from "../graph/model";
import { Icon } from "./icons";

/** The map's size in pixels (React Flow's default is 200x150). */
export const MINIMAP_SIZE = { width: 132, height: 88 } as const;

export function FlowMiniMap({ nodeColor }: { nodeColor: string | ((node: SpecNode) => string) }) {
  const [open, setOpen] = useState(true);
  return (
    <>
      {open && (
        <MiniMap<SpecNode>
          className="flow-minimap"
          style={MINIMAP_SIZE}
          pannable
          zoomable
          nodeStrokeWidth={3}
          nodeColor={nodeColor}
          ariaLabel="Minimap: drag to pan, scroll to zoom"
        />
      )}
      <Panel position="bottom-right" className="minimap-toggle-panel">
        <button
          type="button"
          className="minimap-toggle"
          onClick={() => setOpen((o) => !o)}
          aria-expanded={open}
          title={open ? "Hide the minimap" : "Show the minimap"}
          data-testid="minimap-toggle"
        >
          <Icon name="chevron" size={11} style={{ transform: open ? "rotate(90deg)" : "rotate(-90deg)" }} />
          {open ? "Hide map" : "Map"}
        </button>
      </Panel>
    </>
  );
}
