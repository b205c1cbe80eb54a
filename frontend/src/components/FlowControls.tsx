/**
 * The canvas's zoom buttons and its fit-to-view button, shared by the editor and the run view. The
 * fit button is ours: React Flow's own runs its plain fitView after an `onFitView` callback (it is
 * queued to the next render), which undid the readable fit (`useReadableFit`) the callback made.
 * They sit in the bottom-left corner over the graph: fit-to-view keeps nodes out of CONTROLS_CORNER.
 */
import { ControlButton, Controls } from "@xyflow/react";
import { Icon } from "./icons";

/** React Flow's buttons are 26 px squares (border included), stacked: zoom in, zoom out, fit. */
const BUTTON = 26;
const BUTTONS = 3;
/** React Flow's panel margin from the canvas's left and bottom edges. */
const PANEL_MARGIN = 15;
/** The least room between a fitted node and the buttons. */
const CONTROLS_GAP = 10;
/** The bottom-left corner of the canvas that the buttons, their margin and a gap take: what fit-to-view keeps nodes out of. */
export const CONTROLS_CORNER = {
  width: PANEL_MARGIN + BUTTON + CONTROLS_GAP,
  height: PANEL_MARGIN + BUTTONS * BUTTON + CONTROLS_GAP,
} as const;

export function FlowControls({ onFit }: { onFit: () => void }) {
  return (
    <Controls showInteractive={false} showFitView={false}>
      <ControlButton
        className="react-flow__controls-fitview"
        onClick={onFit}
        title="Fit view"
        aria-label="Fit view"
        data-testid="fit-view"
      >
        {/* React Flow fills its buttons' icons; this one is drawn with strokes. */}
        <Icon name="fit" size={12} style={{ fill: "none" }} />
      </ControlButton>
    </Controls>
  );
}
