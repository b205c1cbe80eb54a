/**
 * Fit a React Flow view (the editor's canvas, a run's graph) to its graph without going below a
 * legible zoom, and with no node under the minimap in the bottom-right corner or under the zoom
 * buttons in the bottom-left one where that can be had (`graph/viewport.ts`). Call it inside the
 * view's ReactFlowProvider.
 */
import { useNodesInitialized, useReactFlow } from "@xyflow/react";
import { type RefObject, useCallback, useEffect, useRef, useState } from "react";
import type { SpecEdge, SpecNode } from "../graph/model";
import { NODE_WIDTH } from "../graph/layout";
import { CONTROLS_CORNER } from "../components/FlowControls";
import { MINIMAP_CORNER } from "../components/FlowMiniMap";
import { readableViewportClearOfCorners, showsWhole, type Viewport } from "../graph/viewport";

export interface ReadableFit {
  /** Show the whole graph when its titles stay legible, else its inputs (or its leftmost nodes) at the legible zoom. */
  fit: (duration?: number) => void;
  /** Whether the last fit showed the whole graph (false: part of it, the minimap shows the rest; null: not fitted yet). */
  whole: boolean | null;
}

/** When the view draws its minimap: always (the editor), or only over a view that shows part of the graph (a run's). */
export type MinimapShown = "always" | "when-partial";

/**
 * `canvas` is the element the view fills. Once the first nodes are measured, it fits by itself when
 * `initial` says so (a graph opened without a saved view, or with one too small to read).
 */
export function useReadableFit(
  canvas: RefObject<HTMLDivElement | null>,
  initial: boolean,
  minimap: MinimapShown,
): ReadableFit {
  const flow = useReactFlow<SpecNode, SpecEdge>();
  const measured = useNodesInitialized();
  const done = useRef(false);
  /** The viewport the last fit set (null: none yet). */
  const fitted = useRef<Viewport | null>(null);
  const [whole, setWhole] = useState<boolean | null>(null);
  const fit = useCallback(
    (duration = 0) => {
      const nodes = flow.getNodes();
      const box = canvas.current?.getBoundingClientRect();
      if (nodes.length === 0 || !box) return;
      let focus: SpecNode[] = nodes.filter((n) => n.data.spec.kind === "input");
      if (focus.length === 0) {
        const left = Math.min(...nodes.map((n) => n.position.x));
        focus = nodes.filter((n) => n.position.x < left + NODE_WIDTH);
      }
      const all = flow.getNodesBounds(nodes);
      // Hidden, the map is a button away: its corner is kept clear either way, so showing it covers nothing.
      const rects = nodes.map((n) => flow.getNodesBounds([n]));
      const viewport = readableViewportClearOfCorners(all, flow.getNodesBounds(focus), rects, box,
        { left: CONTROLS_CORNER, right: MINIMAP_CORNER }, minimap === "always");
      flow.setViewport(viewport, { duration });
      fitted.current = viewport;
      setWhole(showsWhole(all, viewport, box));
    },
    [flow, canvas, minimap],
  );
  useEffect(() => {
    if (!measured || done.current) return;
    done.current = true;
    if (initial) fit();
  }, [measured, initial, fit]);
  // The canvas can change size after the fit (a notice above the graph comes or goes, a line
  // wraps): a view nobody has moved since it was fitted is fitted again to the new size, so the
  // nodes it showed stay clear of the minimap and the buttons. A view the user moved stays.
  useEffect(() => {
    const element = canvas.current;
    if (!element) return;
    let size = { width: element.clientWidth, height: element.clientHeight };
    const observer = new ResizeObserver(() => {
      const now = { width: element.clientWidth, height: element.clientHeight };
      if (now.width === size.width && now.height === size.height) return;
      size = now;
      const last = fitted.current;
      const current = flow.getViewport();
      if (last && last.x === current.x && last.y === current.y && last.zoom === current.zoom) fit();
    });
    observer.observe(element);
    return () => observer.disconnect();
  }, [canvas, flow, fit]);
  return { fit, whole };
}
