/** The editor's other side panels: the selected edge, roles, the workflow document, issues. */
import { BALANCE_POLICIES, IDENT, type Issue, type ModelInfo, type RoleKind, type RoleSpec } from "../api/types";
import { CommitInput, CommitTextArea, JsonInput, SchemaForm } from "../components/forms";
import { Icon } from "../components/icons";
import { Button } from "../components/ui";
import type { PlacedIssues } from "../graph/issues";
import type { EditorDoc, SpecEdge } from "../graph/model";
import { labelFor, RANDOM_WEIGHTS_LABEL, randomFor, seededNote } from "./modelWeights";

export function EdgeInspector({
  doc,
  edge,
  onStream,
  onRemove,
}: {
  doc: EditorDoc;
  edge: SpecEdge;
  onStream: (stream: boolean) => void;
  onRemove: () => void;
}) {
  const src = doc.nodes.find((n) => n.id === edge.source)?.data.spec;
  const dst = doc.nodes.find((n) => n.id === edge.target)?.data.spec;
  const out = src?.outputs?.[edge.sourceHandle ?? ""];
  const inp = dst?.inputs?.[edge.targetHandle ?? ""];
  return (
    <div className="inspector" data-testid="edge-inspector">
      <div className="inspector-head">
        <div>
          <div className="eyebrow">edge</div>
          <h3 className="mono small-h">{edge.id}</h3>
        </div>
        <Button small variant="ghost" icon="trash" onClick={onRemove}>
          Delete
        </Button>
      </div>
      <dl className="kv">
        <dt>From</dt>
        <dd>
          {edge.source}.{edge.sourceHandle} <span className={`type type-${out?.type}`}>{out?.type}</span>
        </dd>
        <dt>To</dt>
        <dd>
          {edge.target}.{edge.targetHandle} <span className={`type type-${inp?.type}`}>{inp?.type}</span>
          {inp?.join && <span className="join">join: {inp.join}</span>}
        </dd>
      </dl>
      <label className="check-row">
        <input type="checkbox" checked={!!edge.data?.stream} onChange={(e) => onStream(e.target.checked)} />
        Stream subscription
      </label>
      <p className="field-hint">
        The target subscribes to the source's frames and starts on the first one (the source must stream).
      </p>
      <IssueList issues={edge.data?.issues ?? []} />
    </div>
  );
}

export function RolesPanel({
  doc,
  roleKinds,
  models,
  placed,
  onAdd,
  onChange,
  onRemove,
}: {
  doc: EditorDoc;
  roleKinds: RoleKind[];
  /** What the Model field offers (`/api/models/`). */
  models: ModelInfo[];
  placed: PlacedIssues;
  onAdd: (kind: string) => void;
  onChange: (name: string, role: RoleSpec) => string | null;
  onRemove: (name: string) => void;
}) {
  return (
    <div className="inspector" data-testid="roles-panel">
      <div className="inspector-head">
        <div>
          <div className="eyebrow">deployable units</div>
          <h3>Roles</h3>
        </div>
        <select
          className="compact-select"
          value=""
          aria-label="Add role"
          onChange={(e) => e.target.value && onAdd(e.target.value)}
        >
          <option value="">+ Add role…</option>
          {roleKinds.map((k) => (
            <option key={k.name} value={k.name}>
              {k.name}
            </option>
          ))}
        </select>
      </div>
      <p className="muted small">
        A role is <em>replicas</em> copies of one compute unit; nodes name the role they run on.
      </p>
      {doc.roles.length === 0 && <p className="muted small">No roles yet. Adding a node that needs one creates it.</p>}
      {doc.roles.map((role) => (
        <RoleCard
          key={role.name}
          role={role}
          kinds={roleKinds}
          models={models}
          users={doc.nodes.filter((n) => n.data.spec.role === role.name).map((n) => n.id)}
          issues={placed.byRole.get(role.name) ?? []}
          onChange={(next) => onChange(role.name, next)}
          onRemove={() => onRemove(role.name)}
        />
      ))}
    </div>
  );
}

function RoleCard({
  role,
  kinds,
  models,
  users,
  issues,
  onChange,
  onRemove,
}: {
  role: RoleSpec;
  kinds: RoleKind[];
  models: ModelInfo[];
  users: string[];
  issues: Issue[];
  onChange: (role: RoleSpec) => string | null;
  onRemove: () => void;
}) {
  const kind = kinds.find((k) => k.name === role.kind);
  const set = (patch: Partial<RoleSpec>) => onChange({ ...role, ...patch });
  return (
    <div className={`role-card${issues.length ? " has-issues" : ""}`} data-testid={`role-${role.name}`}>
      <div className="grid-2">
        <label className="field">
          <span className="field-label">Name</span>
          <CommitInput
            value={role.name}
            check={(v) => (IDENT.test(v) ? null : "an identifier")}
            onCommit={(v) => onChange({ ...role, name: v })}
          />
        </label>
        <label className="field">
          <span className="field-label">Kind</span>
          <select
            value={role.kind}
            onChange={(e) => {
              const next = kinds.find((k) => k.name === e.target.value);
              // A kind that cannot shard runs one rank per replica.
              set({ kind: e.target.value, params: {}, ...(next?.tensor_parallel ? {} : { tp_size: undefined }) });
            }}
          >
            {!kind && <option value={role.kind}>{role.kind} (unknown)</option>}
            {kinds.map((k) => (
              <option key={k.name} value={k.name}>
                {k.name}
              </option>
            ))}
          </select>
        </label>
        <ModelField
          role={role}
          kind={kind}
          models={models}
          issues={issues.filter((i) => i.path === "model")}
          onChange={(model) => set({ model })}
        />
        <label className="field">
          <span className="field-label">Replicas</span>
          <CommitInput
            type="number"
            min={1}
            max={1024}
            value={String(role.replicas ?? 1)}
            check={(v) => (/^\d+$/.test(v) && +v >= 1 && +v <= 1024 ? null : "1–1024")}
            onCommit={(v) => set({ replicas: parseInt(v, 10) })}
          />
        </label>
        <label
          className="field"
          title={
            kind && !kind.tensor_parallel
              ? `${kind.name} roles cannot shard: one rank per replica`
              : "tensor-parallel ranks per replica: each holds a slice of every layer's heads"
          }
        >
          <span className="field-label">Tensor-parallel ranks</span>
          <CommitInput
            type="number"
            min={1}
            max={64}
            data-testid={`role-${role.name}-tp-size`}
            disabled={!!kind && !kind.tensor_parallel && (role.tp_size ?? 1) === 1}
            value={String(role.tp_size ?? 1)}
            check={(v) => (/^\d+$/.test(v) && +v >= 1 && +v <= 64 ? null : "1–64")}
            onCommit={(v) => set({ tp_size: parseInt(v, 10) })}
          />
        </label>
        <label className="field">
          <span className="field-label">Load balancing</span>
          <select value={role.balance ?? "round_robin"} onChange={(e) => set({ balance: e.target.value })}>
            {!BALANCE_POLICIES.includes((role.balance ?? "round_robin") as never) && (
              <option value={role.balance}>{role.balance} (unknown)</option>
            )}
            {BALANCE_POLICIES.map((p) => (
              <option key={p} value={p}>
                {p.replace(/_/g, " ")}
              </option>
            ))}
          </select>
        </label>
        <label className="field">
          <span className="field-label">Device</span>
          <CommitInput list="devices" value={role.device ?? "cpu"} onCommit={(v) => set({ device: v || "cpu" })} />
          <datalist id="devices">
            <option value="cpu" />
            <option value="cuda" />
            <option value="cuda:0" />
            <option value="cuda:1" />
          </datalist>
        </label>
      </div>
      {kind && (
        <details className="details">
          <summary>{kind.name} parameters</summary>
          <SchemaForm schema={kind.params_schema} value={role.params ?? {}} onChange={(params) => set({ params })} />
        </details>
      )}
      <details className="details">
        <summary>Policy parameters and resources</summary>
        <label className="field">
          <span className="field-label">Balance params</span>
          <JsonInput
            value={role.balance_params && Object.keys(role.balance_params).length ? role.balance_params : undefined}
            placeholder="{}"
            onCommit={(v) => set({ balance_params: (v as Record<string, unknown>) ?? {} })}
          />
        </label>
        <label className="field">
          <span className="field-label">Resources</span>
          <JsonInput
            value={role.resources && Object.keys(role.resources).length ? role.resources : undefined}
            placeholder='{"gpu_memory_gb": 8}'
            onCommit={(v) => set({ resources: (v as Record<string, unknown>) ?? {} })}
          />
        </label>
      </details>
      <div className="role-foot">
        <span className="muted small">{users.length ? `Used by ${users.join(", ")}` : "Not used by any node"}</span>
        <Button small variant="ghost" icon="trash" onClick={onRemove} disabled={users.length > 0} title={users.length ? "Nodes still run on this role" : "Remove role"}>
          Remove
        </Button>
      </div>
      <IssueList issues={issues.filter((i) => i.path !== "model")} />
    </div>
  );
}

/** The picker's groups, for a role of `kind`: a model's weights are those a role of that kind gets. */
const MODEL_GROUPS: { label: string; pick: (m: ModelInfo, kind: string) => boolean }[] = [
  { label: "Built-in, real weights", pick: (m, kind) => m.source === "builtin" && !randomFor(m, kind) },
  { label: "Built-in, random weights (for testing)", pick: (m, kind) => m.source === "builtin" && randomFor(m, kind) },
  { label: "Checkpoints in the model directories", pick: (m) => m.source === "checkpoint" },
];

/** A role's model: a picker of what the studio can load for its kind (`/api/models/`). */
function ModelField({
  role,
  kind,
  models,
  issues,
  onChange,
}: {
  role: RoleSpec;
  kind: RoleKind | undefined;
  models: ModelInfo[];
  issues: Issue[];
  onChange: (model: string | null) => void;
}) {
  const fitting = models.filter((m) => m.role_kinds.includes(role.kind));
  const current = role.model ?? "";
  const chosen = fitting.find((m) => m.name === current);
  const takesNone = kind?.model === "none" || (kind !== undefined && kind.model === undefined && fitting.length === 0);
  if (takesNone && !current) {
    return (
      <label className="field span-all" title={`${role.kind} roles take no model`}>
        <span className="field-label">Model</span>
        <select disabled value="" aria-label="Model" data-testid={`role-${role.name}-model`}>
          <option value="">— none —</option>
        </select>
      </label>
    );
  }
  return (
    <label className="field span-all">
      <span className="field-label">Model</span>
      <select
        value={current}
        aria-label="Model"
        data-testid={`role-${role.name}-model`}
        className={issues.length ? "field-bad" : undefined}
        onChange={(e) => onChange(e.target.value || null)}
      >
        <option value="">{kind?.model === "required" ? "— choose a model —" : "— default —"}</option>
        {current && !chosen && <option value={current}>{current} (not available here)</option>}
        {MODEL_GROUPS.map(({ label, pick }) => {
          const items = fitting.filter((m) => pick(m, role.kind));
          return items.length ? (
            <optgroup key={label} label={label}>
              {items.map((m) => (
                <option key={m.name} value={m.name} title={m.description}>
                  {m.name}
                  {randomFor(m, role.kind) ? ` — ${RANDOM_WEIGHTS_LABEL}` : ""}
                </option>
              ))}
            </optgroup>
          ) : null;
        })}
      </select>
      {issues.map((i, n) => (
        <span key={n} className="field-error" data-testid={`role-${role.name}-model-issue`}>
          {i.message}
        </span>
      ))}
      {chosen && (
        <span className="field-hint" data-testid={`role-${role.name}-model-label`}>
          {labelFor(chosen, role.kind)}
          {seededNote(chosen, role.kind) ? ` ${seededNote(chosen, role.kind)}` : ""}
          {chosen.description ? `: ${chosen.description}` : ""}
        </span>
      )}
    </label>
  );
}

export function WorkflowPanel({
  doc,
  onChange,
}: {
  doc: EditorDoc;
  onChange: (patch: Partial<Pick<EditorDoc, "name" | "description" | "meta">>) => void;
}) {
  return (
    <div className="inspector" data-testid="workflow-panel">
      <div className="inspector-head">
        <div>
          <div className="eyebrow">GraphSpec v1</div>
          <h3>Workflow</h3>
        </div>
      </div>
      <label className="field">
        <span className="field-label">Spec name</span>
        <CommitInput
          value={doc.name}
          check={(v) => (IDENT.test(v) ? null : "an identifier")}
          onCommit={(v) => onChange({ name: v })}
        />
      </label>
      <label className="field">
        <span className="field-label">Description</span>
        <CommitTextArea rows={3} value={doc.description} onCommit={(v) => onChange({ description: v })} />
      </label>
      <label className="field">
        <span className="field-label">Meta (JSON object)</span>
        <JsonInput
          value={Object.keys(doc.meta).length ? doc.meta : undefined}
          placeholder="{}"
          onCommit={(v) => onChange({ meta: (v as Record<string, unknown>) ?? {} })}
        />
      </label>
      <dl className="kv">
        <dt>Nodes</dt>
        <dd>{doc.nodes.length}</dd>
        <dt>Edges</dt>
        <dd>{doc.edges.length}</dd>
        <dt>Roles</dt>
        <dd>{doc.roles.length}</dd>
      </dl>
      <p className="muted small">
        Shortcuts: <kbd>Ctrl</kbd>+<kbd>Z</kbd> undo, <kbd>Ctrl</kbd>+<kbd>Shift</kbd>+<kbd>Z</kbd> redo,{" "}
        <kbd>Del</kbd> delete the selection, <kbd>Ctrl</kbd>+<kbd>S</kbd> save.
      </p>
    </div>
  );
}

export function IssueList({ issues, onPick }: { issues: Issue[]; onPick?: (issue: Issue) => void }) {
  if (issues.length === 0) return null;
  return (
    <ul className="issue-list" data-testid="issue-list">
      {issues.map((i, n) => (
        <li key={n}>
          <button type="button" className="issue-item" onClick={() => onPick?.(i)} disabled={!onPick}>
            <Icon name="alert" size={14} />
            <span>
              <span className="code">{i.code}</span>
              {(i.node || i.role) && <span className="issue-where">{i.node ?? i.role}</span>}
              <span className="issue-msg">{i.message}</span>
            </span>
          </button>
        </li>
      ))}
    </ul>
  );
}
