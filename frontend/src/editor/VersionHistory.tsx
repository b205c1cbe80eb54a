/** A workflow's versions, newest first, with the diff of each against the one before it. */
import { useEffect, useState } from "react";
import { describeError } from "../api/client";
import { workflows } from "../api/studio";
import type { SectionDiff, Version, VersionDiff } from "../api/types";
import { Button, ErrorBox, Modal, Spinner, Timestamp } from "../components/ui";
import { CHANGE_MARK, workflowFieldChanges } from "./diff";

export function VersionHistory({
  workflowId,
  current,
  onClose,
  onOpen,
}: {
  workflowId: string;
  current: number | null;
  onClose: () => void;
  onOpen: (version: Version) => void;
}) {
  const [versions, setVersions] = useState<Version[] | null>(null);
  const [selected, setSelected] = useState<number | null>(null);
  const [against, setAgainst] = useState<number | null>(null);
  const [diff, setDiff] = useState<VersionDiff | null>(null);
  const [error, setError] = useState<string | null>(null);

  useEffect(() => {
    workflows
      .versions(workflowId)
      .then((page) => {
        setVersions(page.results);
        if (page.results.length) setSelected(page.results[0].number);
      })
      .catch((err) => setError(describeError(err)));
  }, [workflowId]);

  useEffect(() => {
    if (selected === null) return;
    setDiff(null);
    workflows
      .diff(workflowId, selected, against ?? undefined)
      .then(setDiff)
      .catch((err) => setError(describeError(err)));
  }, [workflowId, selected, against]);

  const chosen = versions?.find((v) => v.number === selected);

  return (
    <Modal title="Version history" onClose={onClose} wide testId="history-dialog">
      {error && <ErrorBox>{error}</ErrorBox>}
      {!versions && !error && <Spinner label="Loading versions" />}
      {versions && versions.length === 0 && <p className="muted">No version saved yet.</p>}
      {versions && versions.length > 0 && (
        <div className="history">
          <ol className="version-list" data-testid="version-list">
            {versions.map((v) => (
              <li key={v.number}>
                <button
                  type="button"
                  className={`version-item${v.number === selected ? " active" : ""}`}
                  onClick={() => {
                    setSelected(v.number);
                    setAgainst(null);
                  }}
                  data-testid={`version-${v.number}`}
                >
                  <span className="version-top">
                    <span className="pill">v{v.number}</span>
                    {v.number === current && <span className="muted small">open</span>}
                    {!v.valid && <span className="danger-text small">issues</span>}
                    <span className="muted small push"><Timestamp iso={v.created_at} ago="inline" /></span>
                  </span>
                  <span className="version-msg">{v.message || <em className="muted">no message</em>}</span>
                  <span className="muted small">{v.author ?? "unknown"}</span>
                </button>
              </li>
            ))}
          </ol>
          <div className="diff-pane">
            {chosen && (
              <div className="diff-head">
                <div>
                  <strong>v{chosen.number}</strong> compared with{" "}
                  <select
                    value={against ?? chosen.number - 1}
                    onChange={(e) => setAgainst(parseInt(e.target.value, 10))}
                    aria-label="Compare with"
                  >
                    {chosen.number - 1 < 1 && <option value={0}>nothing (first version)</option>}
                    {versions
                      .filter((v) => v.number !== chosen.number)
                      .map((v) => (
                        <option key={v.number} value={v.number}>
                          v{v.number}
                        </option>
                      ))}
                  </select>
                </div>
                <div className="head-actions">
                  <a className="btn btn-ghost btn-sm" href={workflows.exportUrl(workflowId, "json", chosen.number)} download>
                    JSON
                  </a>
                  <a className="btn btn-ghost btn-sm" href={workflows.exportUrl(workflowId, "python", chosen.number)} download>
                    Python
                  </a>
                  <Button small onClick={() => onOpen(chosen)} disabled={chosen.number === current}>
                    Open in editor
                  </Button>
                </div>
              </div>
            )}
            {!diff && <Spinner />}
            {diff && <DiffView diff={diff} />}
          </div>
        </div>
      )}
    </Modal>
  );
}

function Section({ title, section }: { title: string; section: SectionDiff }) {
  if (!section.added.length && !section.removed.length && !section.changed.length) return null;
  return (
    <div className="diff-section">
      <div className="section-title">{title}</div>
      <div className="chip-row">
        {section.added.map((id) => (
          <span key={`a${id}`} className={`chip ${CHANGE_MARK.added.chip}`}>
            {CHANGE_MARK.added.sign} {id}
          </span>
        ))}
        {section.removed.map((id) => (
          <span key={`r${id}`} className={`chip ${CHANGE_MARK.removed.chip}`}>
            {CHANGE_MARK.removed.sign} {id}
          </span>
        ))}
        {section.changed.map((c) => (
          <span key={`c${c.id}`} className={`chip ${CHANGE_MARK.changed.chip}`} title={Object.keys(c.fields).join(", ")}>
            {CHANGE_MARK.changed.sign} {c.id} ({Object.keys(c.fields).join(", ")})
          </span>
        ))}
      </div>
    </div>
  );
}

export function DiffView({ diff }: { diff: VersionDiff }) {
  const lines = diff.unified.split("\n");
  const nothing = !diff.unified.trim();
  const fields = workflowFieldChanges(diff);
  return (
    <div className="diff" data-testid="version-diff">
      <Section title="Nodes" section={diff.nodes} />
      <Section title="Edges" section={diff.edges} />
      <Section title="Roles" section={diff.roles} />
      {fields.length > 0 && (
        <div className="diff-section">
          <div className="section-title">Workflow</div>
          <div className="chip-row">
            {fields.map(({ name, change }) => (
              <span key={name} className={`chip ${CHANGE_MARK[change].chip}`} data-change={change}>
                {CHANGE_MARK[change].sign} {name}
              </span>
            ))}
          </div>
        </div>
      )}
      {nothing ? (
        <p className="muted">The specs are identical (the layout or message may differ).</p>
      ) : (
        <pre className="unified">
          {lines.map((l, i) => (
            <div
              key={i}
              className={
                l.startsWith("+++") || l.startsWith("---")
                  ? "u-file"
                  : l.startsWith("@@")
                    ? "u-hunk"
                    : l.startsWith("+")
                      ? "u-add"
                      : l.startsWith("-")
                        ? "u-del"
                        : ""
              }
            >
              {l || " "}
            </div>
          ))}
        </pre>
      )}
    </div>
  );
}
