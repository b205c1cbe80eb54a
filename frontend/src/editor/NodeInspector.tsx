/** The property panel of the selected node: identity, role, op, parameters, ports, control flow. */
import { useMemo, useState } from "react";
import {
  IDENT,
  JOIN_MODES,
  type JoinMode,
  type JsonSchema,
  type NodeKind,
  type NodeSpec,
  type OpInfo,
  PORT_TYPES,
  type PortSpec,
  type PortType,
} from "../api/types";
import { CommitInput, CommitTextArea, SchemaForm } from "../components/forms";
import { Icon } from "../components/icons";
import { Button } from "../components/ui";
import type { EditorDoc } from "../graph/model";
import { INPUT_KIND, INPUT_TYPES, predecessors, successors } from "../graph/ops";

/** What the run form asks for, per input type. */
const INPUT_TYPE_HINTS: Record<string, string> = {
  text: "a text box",
  image: "an image file",
  audio: "an audio file",
  json: "a JSON value",
  tokens: "token ids (a JSON list)",
  tensor: "a tensor file",
  any: "any value: text, or JSON",
};

export interface NodeEdits {
  rename: (from: string, to: string) => string | null;
  patch: (id: string, patch: Partial<NodeSpec>) => void;
  setPorts: (id: string, direction: "inputs" | "outputs", ports: Record<string, PortSpec>, renames?: Record<string, string>) => void;
  addRole: (kind: string) => string;
  /** Make a python node call a registered op, with the op's ports and params. */
  applyOp: (id: string, op: OpInfo) => void;
  remove: (id: string) => void;
}

/** The form of a node's params: a text input's `default` is text typed as it reads, not a JSON value. */
function paramsSchema(spec: NodeSpec, schema: JsonSchema): JsonSchema {
  const declared = schema.properties?.default;
  if (spec.kind !== INPUT_KIND || spec.outputs?.value?.type !== "text" || !declared || declared.type) return schema;
  return { ...schema, properties: { ...schema.properties, default: { ...declared, type: "string" } } };
}

export function NodeInspector({
  doc,
  spec,
  kind,
  ops,
  edits,
}: {
  doc: EditorDoc;
  spec: NodeSpec;
  kind: NodeKind | undefined;
  /** The registered ops (offered for the op field; a registered op's params schema is the form's). */
  ops: OpInfo[];
  edits: NodeEdits;
}) {
  const id = spec.id;
  const opInfo = ops.find((o) => o.name === spec.op);
  const issues = doc.nodes.find((n) => n.id === id)?.data.issues ?? [];
  const roles = doc.roles.filter((r) => kind?.role_kinds.includes(r.kind));
  const [renameError, setRenameError] = useState<string | null>(null);

  return (
    <div className="inspector" data-testid="node-inspector">
      <div className="inspector-head">
        <div>
          <div className="eyebrow">{spec.kind} node</div>
          <h3>{id}</h3>
        </div>
        <Button small variant="ghost" icon="trash" onClick={() => edits.remove(id)} aria-label="Delete node">
          Delete
        </Button>
      </div>
      {kind && <p className="muted small">{kind.description}</p>}
      {!kind && <p className="danger-text small">This installation has no node kind “{spec.kind}”.</p>}
      {issues.some((i) => i.path !== "op") && (
        <ul className="issue-list compact" data-testid="inspector-issues">
          {issues.filter((i) => i.path !== "op").map((i, n) => (
            <li key={n}>
              <span className="code">{i.code}</span> {i.message}
            </li>
          ))}
        </ul>
      )}

      <section className="section">
        <label className="field">
          <span className="field-label">ID</span>
          <CommitInput
            value={id}
            aria-label="Node id"
            data-testid="node-id-input"
            check={(v) => (IDENT.test(v) ? null : "a letter or _, then letters, digits, _ or -")}
            onCommit={(v) => setRenameError(edits.rename(id, v))}
          />
          {renameError && <span className="field-error">{renameError}</span>}
          {(spec.kind === "input" || spec.kind === "output") && (
            <span className="field-hint">The id is the name of the workflow's {spec.kind}.</span>
          )}
        </label>
        {spec.kind === INPUT_KIND && spec.outputs?.value && (
          <label className="field">
            <span className="field-label">Type</span>
            <select
              value={spec.outputs.value.type}
              aria-label="Input type"
              data-testid="input-type"
              onChange={(e) =>
                edits.setPorts(id, "outputs", { ...spec.outputs, value: { ...spec.outputs!.value, type: e.target.value as PortType } })
              }
            >
              {[...INPUT_TYPES, ...(INPUT_TYPES.includes(spec.outputs.value.type) ? [] : [spec.outputs.value.type])].map((t) => (
                <option key={t} value={t}>
                  {t}
                </option>
              ))}
            </select>
            {issues
              .filter((i) => i.code === "type_mismatch")
              .map((i) => (
                <span key={i.message} className="field-error" data-testid="input-type-issue">
                  {i.message}
                </span>
              ))}
            <span className="field-hint" data-testid="input-type-hint">
              A run form asks for {INPUT_TYPE_HINTS[spec.outputs.value.type] ?? `a ${spec.outputs.value.type} value`}
              {!doc.edges.some((e) => e.source === id) && "; drawn to a node's port, it takes that port's type"}.
            </span>
          </label>
        )}
        {kind && kind.role_kinds.length > 0 && (
          <label className="field">
            <span className="field-label">Role</span>
            <select
              value={spec.role ?? ""}
              aria-label="Role"
              onChange={(e) => {
                if (e.target.value === "__new__") edits.patch(id, { role: edits.addRole(kind.role_kinds[0]) });
                else edits.patch(id, { role: e.target.value || null });
              }}
            >
              <option value="">— none —</option>
              {roles.map((r) => (
                <option key={r.name} value={r.name}>
                  {r.name} ({r.kind}
                  {r.replicas && r.replicas > 1 ? ` ×${r.replicas}` : ""}
                  {r.tp_size && r.tp_size > 1 ? `, TP ${r.tp_size}` : ""})
                </option>
              ))}
              <option value="__new__">+ New {kind.role_kinds[0]} role</option>
            </select>
            <span className="field-hint">Runs on a role of kind {kind.role_kinds.join(" or ")}; edit roles in the Roles tab.</span>
          </label>
        )}
        {kind?.op === "required" && <OpField id={id} op={spec.op ?? ""} ops={ops} issues={issues} edits={edits} />}
        <label className="field">
          <span className="field-label">Description</span>
          <CommitTextArea rows={2} value={spec.description ?? ""} onCommit={(v) => edits.patch(id, { description: v })} />
        </label>
      </section>

      <section className="section">
        <div className="section-title">Parameters</div>
        <SchemaForm
          schema={paramsSchema(spec, opInfo?.params_schema ?? kind?.params_schema ?? { type: "object" })}
          value={spec.params ?? {}}
          onChange={(params) => edits.patch(id, { params })}
        />
      </section>

      <section className="section">
        <div className="section-title">Ports</div>
        <PortTable
          title="Inputs"
          direction="inputs"
          ports={spec.inputs ?? {}}
          fixed={kind?.inputs ?? null}
          onChange={(ports, renames) => edits.setPorts(id, "inputs", ports, renames)}
        />
        <PortTable
          title="Outputs"
          direction="outputs"
          ports={spec.outputs ?? {}}
          fixed={kind?.outputs ?? null}
          onChange={(ports, renames) => edits.setPorts(id, "outputs", ports, renames)}
        />
      </section>

      <ControlFlow doc={doc} spec={spec} patch={(p) => edits.patch(id, p)} />
    </div>
  );
}

const OTHER = "__other__";

/**
 * The node's op: a picker of the registered ops (choosing one gives the node the op's ports
 * and params), or, under "Other", a `module:function` where the operator allows module ops.
 */
function OpField({
  id,
  op,
  ops,
  issues,
  edits,
}: {
  id: string;
  op: string;
  ops: OpInfo[];
  issues: { code: string; message: string; path?: string }[];
  edits: NodeEdits;
}) {
  const info = ops.find((o) => o.name === op);
  const [other, setOther] = useState(op !== "" && !info);
  const groups = useMemo(() => {
    const by = new Map<string, OpInfo[]>();
    for (const o of ops) {
      const group = o.name.split(".")[0];
      if (!by.has(group)) by.set(group, []);
      by.get(group)!.push(o);
    }
    return [...by.entries()];
  }, [ops]);
  const fieldIssues = issues.filter((i) => i.path === "op");
  return (
    <div className="field">
      <label className="field-label" htmlFor={`op-${id}`}>
        Operation
      </label>
      <select
        id={`op-${id}`}
        value={info ? op : other || op ? OTHER : ""}
        aria-label="Operation"
        data-testid="node-op-select"
        className={fieldIssues.length ? "field-bad" : undefined}
        onChange={(e) => {
          const value = e.target.value;
          if (value === OTHER) {
            setOther(true);
            return;
          }
          setOther(false);
          const chosen = ops.find((o) => o.name === value);
          if (chosen) edits.applyOp(id, chosen);
          else edits.patch(id, { op: "" });
        }}
      >
        <option value="">— choose a registered op —</option>
        {groups.map(([group, items]) => (
          <optgroup key={group} label={group}>
            {items.map((o) => (
              <option key={o.name} value={o.name} title={o.description}>
                {o.name}
                {o.stream ? " (streams)" : ""}
              </option>
            ))}
          </optgroup>
        ))}
        <option value={OTHER}>Other (a name not in the list)…</option>
      </select>
      {(other || (op && !info)) && (
        <CommitInput
          className="mono"
          value={op}
          placeholder="a registered op, or module:function"
          aria-label="Operation name"
          data-testid="node-op-input"
          onCommit={(v) => {
            const chosen = ops.find((o) => o.name === v);
            if (chosen) {
              setOther(false);
              edits.applyOp(id, chosen);
            } else edits.patch(id, { op: v });
          }}
        />
      )}
      {fieldIssues.map((i, n) => (
        <span key={n} className="field-error" data-testid="node-op-issue">
          {i.message}
        </span>
      ))}
      <span className="field-hint" data-testid="node-op-hint">
        {info ? (
          <>
            {info.description || "A registered op."} Its ports and parameters come from its signature.
          </>
        ) : (
          <>
            The registered ops (<code>/api/ops/</code>); choosing one sets the node's ports and parameters. A{" "}
            <code>module:function</code> runs only where the operator allows module ops.
          </>
        )}
      </span>
    </div>
  );
}

function PortTable({
  title,
  direction,
  ports,
  fixed,
  onChange,
}: {
  title: string;
  direction: "inputs" | "outputs";
  ports: Record<string, PortSpec>;
  fixed: NodeKind["inputs"];
  onChange: (ports: Record<string, PortSpec>, renames?: Record<string, string>) => void;
}) {
  const entries = Object.entries(ports);
  const update = (name: string, next: PortSpec, newName = name) => {
    const out: Record<string, PortSpec> = {};
    for (const [n, p] of entries) out[n === name ? newName : n] = n === name ? next : p;
    onChange(out, newName !== name ? { [name]: newName } : {});
  };
  const clean = (p: PortSpec): PortSpec => {
    const out: PortSpec = { type: p.type };
    if (p.optional) out.optional = true;
    if (p.join) out.join = p.join;
    if (p.description) out.description = p.description;
    return out;
  };
  return (
    <div className="port-table" data-testid={`ports-${direction}`}>
      <div className="port-table-head">
        <span>{title}</span>
        {fixed === null && (
          <Button
            small
            variant="ghost"
            icon="plus"
            onClick={() => {
              let i = entries.length + 1;
              let name = direction === "inputs" ? "x" : "out";
              while (name in ports) name = `${direction === "inputs" ? "in" : "out"}${i++}`;
              onChange({ ...ports, [name]: { type: "json" } });
            }}
          >
            Add
          </Button>
        )}
      </div>
      {entries.length === 0 && <div className="muted small">none</div>}
      {entries.map(([name, port]) => {
        const locked = fixed !== null;
        const narrowable = locked && fixed![name]?.type === "any";
        return (
          <div className="port-edit" key={name}>
            {locked ? (
              <span className="mono port-edit-name">{name}</span>
            ) : (
              <CommitInput
                className="mono port-edit-name"
                value={name}
                aria-label={`${direction} port name`}
                check={(v) => (!IDENT.test(v) ? "an identifier" : v !== name && v in ports ? "taken" : null)}
                onCommit={(v) => update(name, port, v)}
              />
            )}
            <select
              value={port.type}
              disabled={locked && !narrowable}
              aria-label={`${name} type`}
              title={narrowable ? "The kind accepts any type; narrow it here." : undefined}
              onChange={(e) => update(name, clean({ ...port, type: e.target.value as PortType }))}
            >
              {PORT_TYPES.map((t) => (
                <option key={t} value={t}>
                  {t}
                </option>
              ))}
            </select>
            {direction === "inputs" && (
              <select
                value={port.join ?? ""}
                aria-label={`${name} join`}
                title="How several arrivals on this port are gathered"
                onChange={(e) => update(name, clean({ ...port, join: (e.target.value || null) as JoinMode | null }))}
              >
                <option value="">single</option>
                {JOIN_MODES.map((j) => (
                  <option key={j} value={j}>
                    join: {j}
                  </option>
                ))}
              </select>
            )}
            {direction === "inputs" && (
              <label className="check-row small" title="The node may run without this input">
                <input
                  type="checkbox"
                  checked={!!port.optional}
                  disabled={locked}
                  onChange={(e) => update(name, clean({ ...port, optional: e.target.checked }))}
                />
                opt
              </label>
            )}
            {!locked && (
              <button
                type="button"
                className="icon-btn"
                aria-label={`Remove port ${name}`}
                onClick={() => {
                  const out = { ...ports };
                  delete out[name];
                  onChange(out);
                }}
              >
                <Icon name="x" size={14} />
              </button>
            )}
          </div>
        );
      })}
    </div>
  );
}

function ControlFlow({ doc, spec, patch }: { doc: EditorDoc; spec: NodeSpec; patch: (p: Partial<NodeSpec>) => void }) {
  const preds = predecessors(doc, spec.id);
  const succs = successors(doc, spec.id);
  const trigger = spec.trigger ?? null;
  return (
    <section className="section" data-testid="control-flow">
      <div className="section-title">Control flow</div>

      <div className="field">
        <span className="field-label">Trigger (OR of AND groups)</span>
        {preds.length === 0 ? (
          <span className="field-hint">No predecessors: the node fires when the run starts.</span>
        ) : (
          <>
            <label className="check-row">
              <input
                type="checkbox"
                checked={trigger !== null}
                onChange={(e) => patch({ trigger: e.target.checked ? [preds] : null })}
              />
              Custom trigger
            </label>
            {trigger === null ? (
              <span className="field-hint">Default: fires when all of {preds.join(", ")} have delivered.</span>
            ) : (
              <div className="trigger-groups">
                {trigger.map((group, gi) => (
                  <div className="trigger-group" key={gi} data-testid={`trigger-group-${gi}`}>
                    <span className="or-label">{gi === 0 ? "when" : "or"}</span>
                    {preds.map((p) => (
                      <label key={p} className={`toggle-chip${group.includes(p) ? " on" : ""}`}>
                        <input
                          type="checkbox"
                          checked={group.includes(p)}
                          onChange={(e) => {
                            const g = e.target.checked ? preds.filter((x) => x === p || group.includes(x)) : group.filter((x) => x !== p);
                            patch({ trigger: trigger.map((old, i) => (i === gi ? g : old)) });
                          }}
                        />
                        {p}
                      </label>
                    ))}
                    <button
                      type="button"
                      className="icon-btn"
                      aria-label="Remove group"
                      onClick={() => {
                        const rest = trigger.filter((_, i) => i !== gi);
                        patch({ trigger: rest.length ? rest : null });
                      }}
                    >
                      <Icon name="x" size={14} />
                    </button>
                  </div>
                ))}
                <Button small variant="ghost" icon="plus" onClick={() => patch({ trigger: [...trigger, [preds[0]]] })}>
                  OR group
                </Button>
                <span className="field-hint">Fires when every node of any one group has delivered.</span>
              </div>
            )}
          </>
        )}
      </div>

      <div className="field">
        <label className="check-row">
          <input
            type="checkbox"
            checked={spec.routes !== undefined && spec.routes !== null}
            onChange={(e) => patch({ routes: e.target.checked ? succs : null })}
            disabled={!!spec.stream}
          />
          Router
        </label>
        <span className="field-hint">A router's result names which successors run; the others are skipped.</span>
        {spec.routes && (
          <div className="chip-row">
            {succs.length === 0 && <span className="muted small">Connect successors first.</span>}
            {succs.map((s) => (
              <label key={s} className={`toggle-chip${spec.routes!.includes(s) ? " on" : ""}`}>
                <input
                  type="checkbox"
                  checked={spec.routes!.includes(s)}
                  onChange={(e) =>
                    patch({ routes: e.target.checked ? succs.filter((x) => x === s || spec.routes!.includes(x)) : spec.routes!.filter((x) => x !== s) })
                  }
                />
                {s}
              </label>
            ))}
          </div>
        )}
      </div>

      <label className="check-row">
        <input
          type="checkbox"
          checked={!!spec.stream}
          disabled={!!spec.routes}
          onChange={(e) => patch({ stream: e.target.checked })}
        />
        Streams frames
      </label>

      <div className="grid-3">
        <label className="field">
          <span className="field-label" title="max_iterations: how often a node on a cycle may fire">
            Max iter.
          </span>
          <CommitInput
            type="number"
            min={1}
            value={spec.max_iterations ? String(spec.max_iterations) : ""}
            placeholder="none"
            check={(v) => (v === "" || /^[1-9]\d*$/.test(v) ? null : "≥ 1")}
            onCommit={(v) => patch({ max_iterations: v ? parseInt(v, 10) : null })}
          />
        </label>
        <label className="field">
          <span className="field-label">Retries</span>
          <CommitInput
            type="number"
            min={0}
            max={100}
            value={spec.retries ? String(spec.retries) : ""}
            placeholder="0"
            check={(v) => (v === "" || (/^\d+$/.test(v) && parseInt(v, 10) <= 100) ? null : "0–100")}
            onCommit={(v) => patch({ retries: v ? parseInt(v, 10) : 0 })}
          />
        </label>
        <label className="field">
          <span className="field-label">Timeout (s)</span>
          <CommitInput
            type="number"
            min={0}
            step="any"
            value={spec.timeout_s ? String(spec.timeout_s) : ""}
            placeholder="none"
            check={(v) => (v === "" || Number(v) > 0 ? null : "> 0")}
            onCommit={(v) => patch({ timeout_s: v ? Number(v) : null })}
          />
        </label>
      </div>
      <span className="field-hint">A node on a cycle needs a bound: set max iterations on one of its nodes.</span>
    </section>
  );
}
