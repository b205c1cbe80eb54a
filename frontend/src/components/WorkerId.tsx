/**
 * A worker id, which is long (`<workflow>-<deployment>-<role>-<replica>-<pid>`, then `.tp<rank>` or
 * `-r<n>`): its start and its end around an ellipsis, the whole id in its tooltip. It copies whole,
 * with its copy button or as the text selected in it.
 */
import type { ClipboardEvent } from "react";
import { CopyIconButton } from "./CopyButton";
import { middleEllipsis } from "./ellipsis";

/** Characters kept from the id's start (the workflow, part of the deployment) and end (role, replica, pid, rank). */
const HEAD = 10;
const TAIL = 10;

/** `copy` false: no copy button (inside a graph node, where the node's detail has one); selecting still copies whole. */
export function WorkerId({ id, copy = true }: { id: string; copy?: boolean }) {
  const onCopy = (e: ClipboardEvent<HTMLSpanElement>) => {
    const selection = document.getSelection();
    const inside = (node: Node | null | undefined) => node != null && e.currentTarget.contains(node);
    if (!selection || !inside(selection.anchorNode) || !inside(selection.focusNode)) return; // more than the id: as selected
    e.clipboardData.setData("text/plain", id);
    e.preventDefault();
  };
  return (
    <span className="worker-id" title={id} data-testid="worker-id" data-worker-id={id}>
      <span className="worker-id-text" onCopy={onCopy}>
        {middleEllipsis(id, HEAD, TAIL)}
      </span>
      {copy && <CopyIconButton text={id} label="Copy the worker id" testId="worker-id-copy" />}
    </span>
  );
}
