/** Fit the editor's view to its graph without going below a legible zoom (`graph/viewport.ts`). */
import { useNodesInitialized, useReactFlow } from "@xyflow/react";
import { type RefObject, useCallback, useEffect, useRef } from "react";
import type { SpecEdge, SpecNode } from "../graph/model";
import { NODE_WIDTH } from "../graph/layout";
import { readableViewport } from "../graph/viewport";

/**
 * `fit(duration?)` shows the whole graph when its titles stay legible, else its inputs (or its
 * leftmost nodes) at the legible zoom. Once the first nodes are measured, it fits by itself when
 * `initial` says so (a graph opened without a saved view, or with one too small to read).
 */
export function useReadableFit(canvas: RefObject<HTMLDivElement | null>, initial: boolean): (duration?: number) => void {
  const flow = useReactFlow<SpecNode, SpecEdge>();
  const measured = useNodesInitialized();
  const done = useRef(false);
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
      const viewport = readableViewport(flow.getNodesBounds(nodes), flow.getNodesBounds(focus), box);
      flow.setViewport(viewport, { duration });
    },
    [flow, canvas],
  );
  useEffect(() => {
    if (!measured || done.current) return;
    done.current = true;
    if (initial) fit();
  }, [measured, initial, fit]);
  return fit;
}
