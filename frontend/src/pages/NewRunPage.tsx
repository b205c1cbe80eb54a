/**
 * Submit a run: one field per workflow input, by port type (text, JSON, image or audio upload),
 * executed by the studio's own engine or on the role workers of one of the workflow's running
 * deployments (which runs the version it was deployed with); by default on its running
 * deployment when it has exactly one (`defaultTarget`). A text input that feeds llm prompts of a
 * model with its own chat template has a "Chat message" toggle: what the user types is sent as a
 * user message rendered with that template (`run/chatPrompt.ts`).
 */
import { type FormEvent, useEffect, useMemo, useState } from "react";
import { Link, useNavigate, useParams, useSearchParams } from "react-router-dom";
import { cluster, type Deployment } from "../api/cluster";
import { describeError } from "../api/client";
import { parseUserJson } from "../api/json";
import { catalogue, workflows, runs } from "../api/studio";
import type { ChatTemplateInfo, PortType, RunDetail, RunFile, Version, Workflow } from "../api/types";
import { Icon } from "../components/icons";
import { RunGraph } from "../components/RunGraph";
import { Button, ErrorBox, Spinner, formatBytes } from "../components/ui";
import { chatInputs, chatSend, isRendered } from "../run/chatPrompt";
import { type Draft, type InputField, initialDraft, inputsOf } from "../run/formInputs";
import { defaultTarget, type TargetAsked } from "../run/target";

const FILE_TYPES: PortType[] = ["image", "audio", "tensor"];


/** A text input that feeds llm prompts of `model`, whose own chat template renders what is typed. */
interface ChatField {
  model: string;
  template: ChatTemplateInfo;
}

function targetAsked(params: URLSearchParams): TargetAsked {
  const version = params.get("version");
  return { deployment: params.get("deployment"), version: version ? Number(version) : null, from: params.get("from") };
}

function previousFile(run: RunDetail, name: string): RunFile | undefined {
  const value = run.inputs[name];
  if (!value || typeof value !== "object" || !("$file" in value)) return undefined;
  return run.files.find((f) => f.id === (value as { $file: string }).$file);
}

export function NewRunPage() {
  const { id } = useParams<{ id: string }>();
  const [params] = useSearchParams();
  const navigate = useNavigate();
  const [workflow, setWorkflow] = useState<Workflow | null>(null);
  const [versions, setVersions] = useState<Version[]>([]);
  const [number, setNumber] = useState<number | null>(params.get("version") ? Number(params.get("version")) : null);
  const [version, setVersion] = useState<Version | null>(null);
  const [drafts, setDrafts] = useState<Record<string, Draft>>({});
  const [timeout, setTimeoutS] = useState("");
  /** Running deployments of this workflow (null: this studio has no deployment API). */
  const [deployments, setDeployments] = useState<Deployment[] | null>(null);
  /** "" runs in the studio's own engine; otherwise the id of the deployment to run on. */
  const [target, setTarget] = useState(params.get("deployment") ?? "");
  const asked = useMemo(() => targetAsked(params), [params]);
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);

  useEffect(() => {
    if (!id) return;
    Promise.all([workflows.get(id), workflows.versions(id)])
      .then(([w, page]) => {
        setWorkflow(w);
        setVersions(page.results);
        setNumber((n) => n ?? page.results[0]?.number ?? null);
      })
      .catch((err) => setError(describeError(err)));
    cluster
      .deployments(id)
      .then((list) => {
        const running = list === null ? null : list.filter((d) => d.status === "running");
        setDeployments(running);
        // The choice shows once this list is in, so nothing the user picked is overridden here.
        if (running !== null) setTarget(defaultTarget(asked, running));
      })
      .catch((err) => setError(describeError(err)));
  }, [id, asked]);

  const deployment = deployments?.find((d) => d.id === target) ?? null;
  useEffect(() => {
    if (deployment) setNumber(deployment.version); // a deployment runs the version it was deployed with
  }, [deployment]);

  useEffect(() => {
    if (!id || number === null) return;
    const known = versions.find((v) => v.number === number);
    if (known) setVersion(known);
    else workflows.version(id, number).then(setVersion).catch((err) => setError(describeError(err)));
  }, [id, number, versions]);

  const fields = useMemo(() => (version ? inputsOf(version.spec.nodes) : []), [version]);
  // The chat inputs' models, and how each renders chat messages (null while they load; a model the
  // studio cannot find has none). The form runs once they are in, so what is typed goes as the toggle says.
  const chatModels = useMemo(() => (version ? chatInputs(version.spec) : {}), [version]);
  const [templates, setTemplates] = useState<Record<string, ChatTemplateInfo | null> | null>({});
  useEffect(() => {
    const models = [...new Set(Object.values(chatModels))];
    if (models.length === 0) {
      setTemplates({});
      return;
    }
    let stale = false;
    setTemplates(null);
    Promise.all(models.map((m) => catalogue.chatTemplate(m).then((info) => [m, info] as const)))
      .then((found) => !stale && setTemplates(Object.fromEntries(found)))
      .catch((err) => {
        if (stale) return;
        setTemplates({}); // the inputs are sent as typed
        setError(`The chat templates of ${models.join(", ")} could not be read: ${describeError(err)}`);
      });
    return () => {
      stale = true;
    };
  }, [chatModels]);
  const chatField = (name: string): ChatField | null => {
    const model = chatModels[name];
    const template = model && templates ? templates[model] : null;
    return model && template?.template === "model" ? { model, template } : null;
  };
  // "Run again" (`?from=<run>`): the drafts start from that run's inputs, its uploaded files too.
  const from = params.get("from");
  const [previous, setPrevious] = useState<RunDetail | null>(null);
  useEffect(() => {
    if (!from) return;
    runs.get(from).then(setPrevious).catch((err) => setError(describeError(err)));
  }, [from]);
  useEffect(() => {
    if (from && !previous) return;
    let stale = false;
    setDrafts(Object.fromEntries(fields.map((f) => [f.name, initialDraft(f, previous?.inputs[f.name])])));
    if (previous) {
      for (const f of fields) {
        const file = previousFile(previous, f.name);
        if (!file) continue;
        fetch(file.url, { credentials: "same-origin" })
          .then((r) => (r.ok ? r.blob() : Promise.reject(new Error(`${file.filename}: ${r.status}`))))
          .then((blob) => {
            if (stale) return;
            const picked = new File([blob], file.filename, { type: file.content_type });
            setDrafts((d) => ({ ...d, [f.name]: { ...d[f.name], file: picked } }));
          })
          .catch((err) => setError(`The previous run's file for “${f.name}” could not be read: ${describeError(err)}`));
      }
    }
    return () => {
      stale = true;
    };
  }, [fields, from, previous]);

  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (!workflow || !version) return;
    setError(null);
    if (target && !deployment) return; // said beside the form: a deployment that is not running
    const inputs: Record<string, unknown> = {};
    const files: Record<string, File> = {};
    const messages: { name: string; model: string; text: string }[] = [];
    for (const f of fields) {
      const d = drafts[f.name];
      if (!d) continue;
      if (FILE_TYPES.includes(f.type)) {
        if (d.file) files[f.name] = d.file;
        else if (f.defaultValue === undefined) {
          setError(`Choose a file for input “${f.name}”.`);
          return;
        }
        continue;
      }
      if (d.text.trim() === "") {
        if (f.defaultValue !== undefined) continue; // the workflow's default applies
        if (f.type !== "text") {
          setError(`Input “${f.name}” has no default; give it a value.`);
          return;
        }
      }
      if (d.asJson) {
        try {
          inputs[f.name] = parseUserJson(d.text);
        } catch (err) {
          setError(`Input “${f.name}”: ${err instanceof SyntaxError ? "not valid JSON: " : ""}${(err as Error).message}`);
          return;
        }
      } else {
        const chat = chatField(f.name);
        if (chat && chatSend(d.text, d.chat, chat.template.generation_prompt) === "render") {
          messages.push({ name: f.name, model: chat.model, text: d.text });
        } else inputs[f.name] = d.text;
      }
    }
    setBusy(true);
    try {
      for (const m of messages) {
        const rendered = await catalogue.renderChat(m.model, [{ role: "user", content: m.text }]);
        inputs[m.name] = rendered.prompt;
      }
      const on = deployment ? { deployment: deployment.id } : { workflow: workflow.id, version: version.number };
      const run = await runs.submit({
        ...on,
        inputs,
        files,
        timeout_s: timeout ? Number(timeout) : undefined,
      });
      navigate(`/runs/${run.id}`);
    } catch (err) {
      setError(describeError(err));
      setBusy(false);
    }
  };

  if (!workflow) {
    return <div className="page">{error ? <ErrorBox>{error}</ErrorBox> : <Spinner label="Loading" />}</div>;
  }

  return (
    <div className="page page-wide">
      <header className="page-head">
        <div>
          <div className="crumbs">
            <Link to="/workflows">Workflows</Link> / <Link to={`/workflows/${workflow.id}`}>{workflow.name}</Link>
          </div>
          <h1>New run</h1>
          {previous && (
            <p className="muted small" data-testid="run-again-from">
              Inputs from run <Link to={`/runs/${previous.id}`} className="mono">{previous.id.slice(0, 8)}</Link>; change any before you start it.
            </p>
          )}
        </div>
      </header>
      {versions.length === 0 ? (
        <ErrorBox>This workflow has no saved version yet. Save one in the editor first.</ErrorBox>
      ) : (
        <div className="split">
          <form className="card form-card" onSubmit={submit} data-testid="run-form">
            {error && <ErrorBox>{error}</ErrorBox>}
            <label className="field">
              <span className="field-label">Version</span>
              <select
                value={number ?? ""}
                onChange={(e) => setNumber(Number(e.target.value))}
                disabled={deployment !== null}
                data-testid="run-version"
              >
                {versions.map((v) => (
                  <option key={v.number} value={v.number}>
                    v{v.number} — {v.message || "no message"}
                    {v.valid ? "" : " (has issues)"}
                  </option>
                ))}
              </select>
            </label>
            {deployments !== null && (deployments.length > 0 || target !== "") && (
              <label className="field">
                <span className="field-label">Run on</span>
                <select value={target} onChange={(e) => setTarget(e.target.value)} data-testid="run-target">
                  <option value="">The studio's own engine</option>
                  {target !== "" && !deployment && <option value={target}>Deployment {target.slice(0, 8)} (not running)</option>}
                  {deployments.map((d) => (
                    <option key={d.id} value={d.id}>
                      Deployment {d.name || d.id.slice(0, 8)} (v{d.version}) — its role workers
                    </option>
                  ))}
                </select>
              </label>
            )}
            {target && deployments !== null && !deployment && (
              <ErrorBox>
                Deployment {target} is not running for this workflow: choose where to run.
              </ErrorBox>
            )}
            {version && !version.valid && (
              <ErrorBox>
                Version {version.number} has validation issues and cannot run:{" "}
                {version.issues.map((i) => i.message).join("; ")}
              </ErrorBox>
            )}
            <div className="section-title">Inputs</div>
            {fields.length === 0 && <p className="muted small">This workflow takes no inputs.</p>}
            {fields.map((f) => (
              <InputEditor
                key={f.name}
                field={f}
                draft={drafts[f.name] ?? initialDraft(f)}
                chat={chatField(f.name)}
                onChange={(d) => setDrafts((all) => ({ ...all, [f.name]: d }))}
              />
            ))}
            <details className="details">
              <summary>Options</summary>
              <label className="field">
                <span className="field-label">Timeout (seconds)</span>
                <input
                  type="number"
                  min={0.001}
                  step="any"
                  value={timeout}
                  onChange={(e) => setTimeoutS(e.target.value)}
                  placeholder="the studio's default"
                />
              </label>
            </details>
            <div className="form-actions">
              <Button variant="primary" icon="play" type="submit" disabled={busy || templates === null || !version?.valid || (target !== "" && deployments !== null && !deployment)} data-testid="submit-run">
                {busy ? "Submitting…" : "Run"}
              </Button>
            </div>
          </form>
          <div className="card graph-card">
            {version ? <RunGraph spec={version.spec} layout={version.layout} /> : <Spinner />}
          </div>
        </div>
      )}
    </div>
  );
}

function InputEditor({ field, draft, chat, onChange }: {
  field: InputField;
  draft: Draft;
  chat: ChatField | null;
  onChange: (d: Draft) => void;
}) {
  const [preview, setPreview] = useState<string | null>(null);
  useEffect(() => {
    if (!draft.file) {
      setPreview(null);
      return;
    }
    const url = URL.createObjectURL(draft.file);
    setPreview(url);
    return () => URL.revokeObjectURL(url);
  }, [draft.file]);

  const label = (
    <span className="field-label">
      {field.name} <span className={`type type-${field.type}`}>{field.type}</span>
      {field.defaultValue !== undefined && <span className="muted small"> · has a default</span>}
    </span>
  );

  if (FILE_TYPES.includes(field.type)) {
    const accept = field.type === "image" ? "image/*" : field.type === "audio" ? "audio/*" : undefined;
    return (
      <div className="field" data-testid={`input-${field.name}`}>
        {label}
        <label className="file-pick">
          <Icon name="upload" />
          <span>{draft.file ? `${draft.file.name} (${formatBytes(draft.file.size)})` : `Choose ${field.type === "tensor" ? "a" : "an"} ${field.type} file`}</span>
          <input type="file" accept={accept} hidden onChange={(e) => onChange({ ...draft, file: e.target.files?.[0] ?? null })} />
        </label>
        {preview && field.type === "image" && <img className="input-preview" src={preview} alt={`${field.name} preview`} />}
        {preview && field.type === "audio" && <audio controls src={preview} className="audio" />}
        {field.description && <span className="field-hint">{field.description}</span>}
      </div>
    );
  }

  const json = field.type !== "text" && (field.type !== "any" || draft.asJson);
  const asChat = chat !== null && draft.chat;
  let placeholder = field.defaultValue !== undefined ? `default: ${JSON.stringify(field.defaultValue)}` : json ? "JSON value" : "";
  if (asChat) placeholder = field.defaultValue !== undefined ? "Type a message (empty: the workflow's default prompt)" : "Type a message";
  return (
    <div className="field" data-testid={`input-${field.name}`}>
      {label}
      <textarea
        className={json ? "mono" : undefined}
        rows={field.type === "text" ? 3 : 2}
        value={draft.text}
        placeholder={placeholder}
        onChange={(e) => onChange({ ...draft, text: e.target.value, asJson: field.type === "any" ? draft.asJson : json })}
        aria-label={field.name}
      />
      {field.type === "any" && (
        <label className="check-row small">
          <input type="checkbox" checked={draft.asJson} onChange={(e) => onChange({ ...draft, asJson: e.target.checked })} />
          Parse as JSON
        </label>
      )}
      {chat && (
        <label className="check-row small" data-testid={`chat-toggle-${field.name}`}>
          <input type="checkbox" checked={draft.chat} onChange={(e) => onChange({ ...draft, chat: e.target.checked })} />
          Chat message
        </label>
      )}
      <span className="field-hint" data-testid={`input-hint-${field.name}`}>
        {asChat
          ? isRendered(draft.text, chat.template.generation_prompt)
            ? `This text is already in ${chat.model}'s chat template: it is sent as it is.`
            : `Sent as your message in ${chat.model}'s chat template, as a chat client sends it. Turn it off to send the text exactly as typed.`
          : field.description ||
            (field.type === "json" || field.type === "tokens" ? "A JSON value (numbers, lists, objects…)." : "")}
      </span>
    </div>
  );
}
