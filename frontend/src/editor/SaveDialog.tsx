/** Save the editor's document as a new version (a draft when it has issues). */
import { useState } from "react";
import { describeError } from "../api/client";
import { workflows } from "../api/studio";
import type { GraphSpec, Version } from "../api/types";
import { Button, ErrorBox, Modal } from "../components/ui";
import type { docLayout } from "../graph/model";

export function SaveDialog({
  workflowId,
  spec,
  layout,
  base,
  issueCount,
  onClose,
  onSaved,
}: {
  workflowId: string;
  spec: GraphSpec;
  layout: ReturnType<typeof docLayout>;
  base: number | null;
  issueCount: number;
  onClose: () => void;
  onSaved: (v: Version, created: boolean) => void;
}) {
  const [message, setMessage] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const save = async () => {
    setBusy(true);
    setError(null);
    try {
      const v = await workflows.saveVersion(workflowId, { spec, layout, message, base: base ?? undefined });
      onSaved(v, v.number !== base);
    } catch (err) {
      setError(describeError(err));
      setBusy(false);
    }
  };
  return (
    <Modal
      title={`Save as version ${(base ?? 0) + 1}`}
      onClose={onClose}
      testId="save-dialog"
      footer={
        <>
          <Button onClick={onClose}>Cancel</Button>
          <Button variant="primary" icon="save" onClick={save} disabled={busy} data-testid="save-submit">
            Save version
          </Button>
        </>
      }
    >
      <form
        className="stack"
        onSubmit={(e) => {
          e.preventDefault();
          save();
        }}
      >
        {error && <ErrorBox>{error}</ErrorBox>}
        {issueCount > 0 && (
          <div className="info-box">
            The workflow has {issueCount} validation issue{issueCount === 1 ? "" : "s"}. It is saved as a draft and cannot
            run until they are fixed.
          </div>
        )}
        <label className="field">
          <span className="field-label">Message</span>
          <input
            value={message}
            onChange={(e) => setMessage(e.target.value)}
            placeholder="What changed?"
            data-testid="save-message"
          />
        </label>
      </form>
    </Modal>
  );
}
