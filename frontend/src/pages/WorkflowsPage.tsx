import { type FormEvent, useCallback, useEffect, useRef, useState } from "react";
import { Link, useNavigate } from "react-router-dom";
import { describeError } from "../api/client";
import { workflows } from "../api/studio";
import { IDENT, type Workflow } from "../api/types";
import { Icon } from "../components/icons";
import { useToast } from "../components/toast";
import { Button, EmptyState, ErrorBox, Field, Modal, Spinner, Timestamp } from "../components/ui";

export function WorkflowsPage() {
  const [search, setSearch] = useState("");
  const [items, setItems] = useState<Workflow[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [creating, setCreating] = useState(false);
  const [importing, setImporting] = useState(false);
  const [deleting, setDeleting] = useState<Workflow | null>(null);
  const toast = useToast();

  const load = useCallback(async (q: string) => {
    try {
      const page = await workflows.list(q);
      setItems(page.results);
      setError(null);
    } catch (err) {
      setError(describeError(err));
    }
  }, []);

  useEffect(() => {
    const t = window.setTimeout(() => load(search), search ? 200 : 0);
    return () => window.clearTimeout(t);
  }, [search, load]);

  return (
    <div className="page">
      <header className="page-head">
        <div>
          <h1>Workflows</h1>
          <p className="muted">Graphs of model roles, versioned. Open one to edit, run or export it.</p>
        </div>
        <div className="head-actions">
          <Button icon="upload" onClick={() => setImporting(true)} data-testid="import-workflow">
            Import
          </Button>
          <Button variant="primary" icon="plus" onClick={() => setCreating(true)} data-testid="new-workflow">
            New workflow
          </Button>
        </div>
      </header>

      <div className="toolbar">
        <div className="search">
          <Icon name="search" />
          <input
            type="search"
            placeholder="Search workflows by name"
            value={search}
            onChange={(e) => setSearch(e.target.value)}
            aria-label="Search workflows"
          />
        </div>
        {items && <span className="muted small">{items.length} shown</span>}
      </div>

      {error && <ErrorBox>{error}</ErrorBox>}
      {items === null && !error && <Spinner label="Loading workflows" />}
      {items && items.length === 0 && (
        <EmptyState
          icon="flow"
          title={search ? `No workflow matches “${search}”` : "No workflows yet"}
          action={
            !search && (
              <Button variant="primary" icon="plus" onClick={() => setCreating(true)}>
                New workflow
              </Button>
            )
          }
        >
          {!search && "Create one and draw it in the editor, or import a GraphSpec (.json) or Python DSL (.py) file."}
        </EmptyState>
      )}
      {items && items.length > 0 && (
        <div className="card">
          <table className="table" data-testid="workflow-table">
            <thead>
              <tr>
                <th>Name</th>
                <th>Latest version</th>
                <th>Updated</th>
                <th className="right">Actions</th>
              </tr>
            </thead>
            <tbody>
              {items.map((w) => (
                <tr key={w.id} data-testid={`workflow-row-${w.name}`}>
                  <td>
                    <Link to={`/workflows/${w.id}`} className="row-title">
                      {w.name}
                    </Link>
                    {w.description && <div className="muted small clamp">{w.description}</div>}
                  </td>
                  <td>
                    {w.latest_version ? (
                      <span className="version-cell">
                        <span className="pill">v{w.latest_version.number}</span>
                        {w.latest_version.valid ? (
                          <span className="ok-text small">valid</span>
                        ) : (
                          <span className="danger-text small">has issues</span>
                        )}
                        <span className="muted small clamp">{w.latest_version.message}</span>
                      </span>
                    ) : (
                      <span className="muted small">no version saved</span>
                    )}
                  </td>
                  <td className="muted small nowrap"><Timestamp iso={w.updated_at} ago="below" /></td>
                  <td className="right nowrap">
                    <Link className="btn btn-ghost btn-sm" to={`/workflows/${w.id}`}>
                      <Icon name="flow" size={14} /> Edit
                    </Link>
                    {w.latest_version && (
                      <Link className="btn btn-ghost btn-sm" to={`/workflows/${w.id}/run`}>
                        <Icon name="play" size={14} /> Run
                      </Link>
                    )}
                    <Button
                      small
                      variant="ghost"
                      icon="trash"
                      aria-label={`Delete ${w.name}`}
                      onClick={() => setDeleting(w)}
                    />
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}

      {creating && <CreateDialog onClose={() => setCreating(false)} />}
      {importing && <ImportDialog onClose={() => setImporting(false)} />}
      {deleting && (
        <Modal
          title={`Delete ${deleting.name}?`}
          onClose={() => setDeleting(null)}
          footer={
            <>
              <Button onClick={() => setDeleting(null)}>Keep it</Button>
              <Button
                variant="danger"
                icon="trash"
                data-testid="confirm-delete"
                onClick={async () => {
                  try {
                    await workflows.remove(deleting.id);
                    toast(`Deleted ${deleting.name}`, "success");
                    setDeleting(null);
                    load(search);
                  } catch (err) {
                    toast(describeError(err), "error");
                  }
                }}
              >
                Delete
              </Button>
            </>
          }
        >
          <p>
            This deletes the workflow with its {deleting.version_count} version
            {deleting.version_count === 1 ? "" : "s"} and its runs. It cannot be undone.
          </p>
        </Modal>
      )}
    </div>
  );
}

function CreateDialog({ onClose }: { onClose: () => void }) {
  const [name, setName] = useState("");
  const [description, setDescription] = useState("");
  const [error, setError] = useState<string | null>(null);
  const navigate = useNavigate();
  const nameOk = IDENT.test(name);

  const submit = async (e?: FormEvent) => {
    e?.preventDefault();
    if (!nameOk) return;
    try {
      const wf = await workflows.create({ name, description });
      navigate(`/workflows/${wf.id}`);
    } catch (err) {
      setError(describeError(err));
    }
  };

  return (
    <Modal
      title="New workflow"
      onClose={onClose}
      testId="create-dialog"
      footer={
        <>
          <Button onClick={onClose}>Cancel</Button>
          <Button variant="primary" disabled={!nameOk} onClick={() => submit()} data-testid="create-submit">
            Create and open editor
          </Button>
        </>
      }
    >
      <form onSubmit={submit} className="stack">
        {error && <ErrorBox>{error}</ErrorBox>}
        <Field
          label="Name"
          hint={
            name && !nameOk
              ? "Use a letter or _, then letters, digits, _ or - (it names the GraphSpec too)."
              : "Letters, digits, _ and -; it is also the GraphSpec's name."
          }
        >
          <input name="name" value={name} onChange={(e) => setName(e.target.value)} placeholder="caption-images" />
        </Field>
        <Field label="Description">
          <textarea rows={2} value={description} onChange={(e) => setDescription(e.target.value)} />
        </Field>
      </form>
    </Modal>
  );
}

function ImportDialog({ onClose }: { onClose: () => void }) {
  const [file, setFile] = useState<File | null>(null);
  const [text, setText] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const [over, setOver] = useState(false);
  const input = useRef<HTMLInputElement>(null);
  const navigate = useNavigate();

  const submit = async () => {
    setBusy(true);
    setError(null);
    try {
      let wf: Workflow;
      if (file) wf = await workflows.importFile(file);
      else {
        const trimmed = text.trim();
        wf = await workflows.importText(trimmed, trimmed.startsWith("{") ? "json" : "python");
      }
      navigate(`/workflows/${wf.id}`);
    } catch (err) {
      setError(describeError(err));
    } finally {
      setBusy(false);
    }
  };

  return (
    <Modal
      title="Import a workflow"
      onClose={onClose}
      wide
      testId="import-dialog"
      footer={
        <>
          <Button onClick={onClose}>Cancel</Button>
          <Button
            variant="primary"
            icon="upload"
            disabled={busy || (!file && !text.trim())}
            onClick={submit}
            data-testid="import-submit"
          >
            Import
          </Button>
        </>
      }
    >
      <div className="stack">
        {error && <ErrorBox>{error}</ErrorBox>}
        <div
          className={`dropzone${over ? " over" : ""}`}
          onDragOver={(e) => {
            e.preventDefault();
            setOver(true);
          }}
          onDragLeave={() => setOver(false)}
          onDrop={(e) => {
            e.preventDefault();
            setOver(false);
            const f = e.dataTransfer.files[0];
            if (f) setFile(f);
          }}
          onClick={() => input.current?.click()}
        >
          <Icon name="file" size={22} />
          {file ? (
            <span>
              <strong>{file.name}</strong> <span className="muted">({file.size} bytes)</span>
            </span>
          ) : (
            <span>
              Drop a <code>.json</code> GraphSpec or a <code>.py</code> DSL file here, or <u>choose one</u>
            </span>
          )}
          <input
            ref={input}
            type="file"
            accept=".json,.py,application/json,text/x-python"
            hidden
            data-testid="import-file"
            onChange={(e) => setFile(e.target.files?.[0] ?? null)}
          />
        </div>
        <div className="or">or paste it</div>
        <textarea
          className="mono"
          rows={8}
          value={text}
          disabled={!!file}
          onChange={(e) => setText(e.target.value)}
          placeholder={'{"version": 1, "name": "…", "roles": [], "nodes": [], "edges": []}\n\nor DSL source: wf = Workflow("…")'}
          aria-label="GraphSpec JSON or Python DSL source"
        />
        <p className="muted small">
          Python sources are read, not executed: only <code>Workflow(…)</code> and its <code>role</code>,{" "}
          <code>node</code>, <code>python</code>, <code>input</code>, <code>output</code> and <code>edge</code>{" "}
          calls with literal arguments are accepted, and imports of registered ops (<code>@op</code> functions).
        </p>
      </div>
    </Modal>
  );
}
