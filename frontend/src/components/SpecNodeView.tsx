/** A GraphSpec node on the canvas: typed port handles, badges, issues, and its run state. */
import { Handle, type NodeProps, Position, useUpdateNodeInternals } from "@xyflow/react";
import { memo, useEffect } from "react";
import type { PortSpec } from "../api/types";
import { issuePorts } from "../graph/issues";
import type { NodeRunView, SpecNode } from "../graph/model";
import { Icon, type IconName } from "./icons";
import { formatMs } from "./ui";
import { WorkerId } from "./WorkerId";

function iconOf(kind: string): IconName {
  if (kind === "input") return "input";
  if (kind === "output") return "file";
  return kind === "python" ? "code" : "cpu";
}

const JOIN_SHORT: Record<string, string> = { all: "all", ordered: "ord", dynamic: "dyn" };

/** A port's full text on hover: a narrow node cuts its name short. */
export function portTitle(name: string, port: PortSpec): string {
  const head = `${name}${port.optional ? "?" : ""}: ${port.type}${port.join ? ` (join: ${port.join})` : ""}`;
  return port.description ? `${head} — ${port.description}` : head;
}

function PortLabel({ name, port, side, bad }: { name: string; port: PortSpec; side: "in" | "out"; bad: boolean }) {
  return (
    <span className={`port port-${side}${bad ? " port-issue" : ""}`} title={portTitle(name, port)}>
      {side === "out" && <span className={`type type-${port.type}`}>{port.type}</span>}
      <span className="port-name">
        {name}
        {port.optional ? "?" : ""}
      </span>
      {side === "in" && <span className={`type type-${port.type}`}>{port.type}</span>}
      {side === "in" && port.join && (
        <span className="join" title={`join: ${port.join}`}>
          {JOIN_SHORT[port.join]}
        </span>
      )}
    </span>
  );
}

/**
 * A run's one line under its state: the error when it failed, its progress message while it runs,
 * else where it ran (the rest is in the line's tooltip and the run page's node panel). One line
 * always, empty before it starts: a node keeps its size through the run, so a view fitted clear of
 * the minimap and the zoom buttons stays clear as the run goes on.
 */
function RunDetail({ run }: { run: NodeRunView }) {
  const where = run.worker ? `ran on worker ${run.worker}${run.host ? ` on host ${run.host}` : ""}` : "";
  if (run.error) {
    return (
      <div className="spec-node-detail spec-node-failed" title={where ? `${run.error}\n${where}` : run.error}>
        <Icon name="alert" size={11} />
        <span className="spec-node-detail-text">{run.error}</span>
      </div>
    );
  }
  if (run.state === "running" && run.message) {
    return (
      <div className="spec-node-detail muted" data-testid="node-progress-text" title={run.message}>
        <span className="spec-node-detail-text">{run.message}</span>
      </div>
    );
  }
  return (
    <div className="spec-node-detail muted" title={where || undefined}>
      {run.worker && (
        <>
          <Icon name="cpu" size={11} />
          {run.host && <span className="spec-node-detail-text">{run.host} ·</span>}
          <WorkerId id={run.worker} copy={false} />
        </>
      )}
    </div>
  );
}

function SpecNodeViewImpl({ id, data, selected }: NodeProps<SpecNode>) {
  const { spec, issues, roleIssues, run } = data;
  const inputs = Object.entries(spec.inputs ?? {});
  const outputs = Object.entries(spec.outputs ?? {});
  const rows = Math.max(inputs.length, outputs.length);
  // React Flow measures a node's handles when the node resizes; a port renamed in place (a python
  // node's `x` becoming its op's `name`) keeps the size, so its edges would wait on a handle it never
  // measured. Re-measure whenever the port names change.
  const updateNodeInternals = useUpdateNodeInternals();
  const handleKey = `${inputs.map(([name]) => name).join(",")}|${outputs.map(([name]) => name).join(",")}`;
  useEffect(() => updateNodeInternals(id), [id, handleKey, updateNodeInternals]);
  const badPorts = issuePorts(issues);
  const classes = ["spec-node", `cat-${spec.kind === "input" || spec.kind === "output" ? "io" : spec.role ? "role" : "exec"}`];
  if (selected) classes.push("selected");
  if (issues?.length) classes.push("has-issues");
  else if (roleIssues?.length && !run) classes.push("has-role-issues");
  if (run) classes.push(`state-${run.state}`);
  const icon = iconOf(spec.kind);

  return (
    <div className={classes.join(" ")} data-testid={`node-${id}`} data-state={run?.state}>
      <div className="spec-node-head">
        <span className="kind-icon">
          <Icon name={icon} size={14} />
        </span>
        <div className="spec-node-title">
          <div className="spec-node-id">{id}</div>
          <div className="spec-node-sub">
            {spec.kind}
            {spec.role ? ` · ${spec.role}` : ""}
          </div>
        </div>
        {issues && issues.length > 0 && (
          <span className="issue-count" title={issues.map((i) => i.message).join("\n")} data-testid="node-issue-count">
            {issues.length}
          </span>
        )}
      </div>
      {spec.op !== undefined && spec.op !== null && (
        <div className={`spec-node-op${spec.op ? "" : " missing"}`} title={spec.op || "no op set"}>
          {spec.op || "no op set"}
        </div>
      )}
      {(spec.routes || spec.stream || spec.trigger || spec.max_iterations) && (
        <div className="chips">
          {spec.routes && <span className="chip">router</span>}
          {spec.stream && <span className="chip">stream</span>}
          {spec.trigger && <span className="chip">trigger: {spec.trigger.map((g) => g.join("+")).join(" | ")}</span>}
          {spec.max_iterations && <span className="chip">loop ≤ {spec.max_iterations}</span>}
        </div>
      )}
      {rows > 0 && (
        <div className="ports">
          {Array.from({ length: rows }, (_, i) => {
            const inp = inputs[i];
            const out = outputs[i];
            return (
              <div className="port-row" key={i}>
                {inp ? (
                  <>
                    <Handle
                      type="target"
                      position={Position.Left}
                      id={inp[0]}
                      className={`handle type-${inp[1].type}`}
                      data-testid={`port-${id}-in-${inp[0]}`}
                    />
                    <PortLabel name={inp[0]} port={inp[1]} side="in" bad={badPorts.has(inp[0])} />
                  </>
                ) : (
                  <span />
                )}
                {out ? (
                  <>
                    <PortLabel name={out[0]} port={out[1]} side="out" bad={badPorts.has(out[0])} />
                    <Handle
                      type="source"
                      position={Position.Right}
                      id={out[0]}
                      className={`handle type-${out[1].type}`}
                      data-testid={`port-${id}-out-${out[0]}`}
                    />
                  </>
                ) : (
                  <span />
                )}
              </div>
            );
          })}
        </div>
      )}
      {issues && issues.length > 0 && !run && (
        <div className="spec-node-issue" data-testid="node-issue">
          <Icon name="alert" size={12} />
          <span>{issues[0].message}</span>
        </div>
      )}
      {roleIssues && roleIssues.length > 0 && !run && (
        <div className="spec-node-issue role-issue" data-testid="node-role-issue" title={roleIssues.map((i) => i.message).join("\n")}>
          <Icon name="alert" size={12} />
          <span>
            role {spec.role}: {roleIssues[0].code === "model_missing" ? "needs a model" : roleIssues[0].message}
          </span>
        </div>
      )}
      {run && (
        <div className="spec-node-run">
          <span className={`state-chip state-${run.state}`} data-testid="node-state">
            {run.state}
          </span>
          {run.iterations !== undefined && run.iterations > 1 && <span className="muted">×{run.iterations}</span>}
          <span className="timing">{formatMs(run.durationMs)}</span>
          {run.progress !== null && run.progress !== undefined && run.state === "running" && (
            <div
              className="progress"
              role="progressbar"
              aria-valuemin={0}
              aria-valuemax={100}
              aria-valuenow={Math.round(run.progress * 100)}
              data-testid="node-progress"
            >
              <div style={{ width: `${Math.round(run.progress * 100)}%` }} />
            </div>
          )}
        </div>
      )}
      {run && <RunDetail run={run} />}
    </div>
  );
}

export const SpecNodeView = memo(SpecNodeViewImpl);
export const nodeTypes = { spec: SpecNodeView };
