/**
 * The canvas's minimap, small and foldable: it sits in the bottom-right corner over the graph, so
 * it takes little room (a third of React Flow's default area) and a button under it hides it (and
 * brings it back). Fit-to-view (`useReadableFit`) keeps nodes out of MINIMAP_CORNER, the room the
 * map and its button take, so a fitted graph starts clear of it.
 */
import { MiniMap, Panel } from "@xyflow/react";
import { useState } from "react";
import type { SpecNode } from "../graph/model";
import { Icon } from "./icons";

/** The map's size in pixels (React Flow's default is 200x150). */
export const MINIMAP_SIZE = { width: 132, height: 88 } as const;
/** The map's distance from the canvas's right edge (React Flow's panel margin) and bottom edge (room for its button). */
const MINIMAP_MARGIN = { right: 15, bottom: 44 } as const;
/** The least room between a fitted node and the map. */
const MINIMAP_GAP = 10;
/** The bottom-right corner of the canvas that the map, its button and a gap take: what fit-to-view keeps nodes out of. */
export const MINIMAP_CORNER = {
  width: MINIMAP_SIZE.width + MINIMAP_MARGIN.right + MINIMAP_GAP,
  height: MINIMAP_SIZE.height + MINIMAP_MARGIN.bottom + MINIMAP_GAP,
} as const;

export function FlowMiniMap({ nodeColor }: { nodeColor: string | ((node: SpecNode) => string) }) {
  const [open, setOpen] = useState(true);
  return (
    <>
      {open && (
        <MiniMap<SpecNode>
          className="flow-minimap"
          style={{ ...MINIMAP_SIZE, marginRight: MINIMAP_MARGIN.right, marginBottom: MINIMAP_MARGIN.bottom }}
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
