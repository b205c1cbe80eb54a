/**
 * The canvas's zoom buttons and its fit-to-view button, shared by the editor and the run view. The
 * fit button is ours: React Flow's own runs its plain fitView after an `onFitView` callback (it is
 * queued to the next render), which undid the readable fit (`useReadableFit`) the callback made.
 */
import { ControlButton, Controls } from "@xyflow/react";
import { Icon } from "./icons";

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
