/** How a client reaches a deployment: its OpenAI endpoint (base URL + model name) and snippets to paste. */
import { useState } from "react";
import { Link } from "react-router-dom";
import type { DeploymentDetail } from "../api/deployments";
import { CopyBlock, CopyButton } from "../components/CopyButton";
import { TOKEN_ENV, curlSnippet, openaiBaseUrl, pythonSnippet, runSnippet } from "./snippets";

/** What a deployment that is not running serves now (nothing, or requests that wait); null while it runs. */
function notServing(status: DeploymentDetail["status"]): string | null {
  switch (status) {
    case "running":
      return null;
    case "pending":
    case "starting":
      return "Starting: a request sent now waits until its workers are up.";
    case "failed":
      return "Failed: this deployment serves nothing (its workers below say why). Deploy the workflow again once it is fixed.";
    case "stopping":
      return "Stopping: its workers are ending; it serves nothing once they are gone.";
    default:
      return "Stopped: this deployment serves nothing any more. Deploy the workflow again to serve it.";
  }
}

function NotServing({ deployment }: { deployment: DeploymentDetail }) {
  const note = notServing(deployment.status);
  if (note === null) return null;
  return (
    <p className={deployment.status === "failed" ? "danger-text small" : "muted small"} data-testid="endpoint-not-serving">
      {note}
    </p>
  );
}

export function EndpointPanel({ deployment }: { deployment: DeploymentDetail }) {
  const [tab, setTab] = useState<"curl" | "python">("curl");
  const origin = window.location.origin;
  const base = openaiBaseUrl(origin);
  if (!deployment.chat) {
    return (
      <section className="endpoint" data-testid="endpoint">
        <div className="section-title">Endpoint</div>
        <NotServing deployment={deployment} />
        <p className="muted small">
          Not a chat workflow (one text input, one llm node, a text output), so <code>/v1</code> does not serve it.
          Submit runs to it through the REST API with an <Link to="/tokens">API token</Link> in <code>${TOKEN_ENV}</code>{" "}
          (inputs by name, here at their defaults or a sample value; the answer is the run, followed at{" "}
          <code>/api/runs/&lt;id&gt;/</code>):
        </p>
        <CopyBlock text={runSnippet(origin, deployment.id, deployment.inputs ?? [])} testId="snippet-run" />
      </section>
    );
  }
  return (
    <section className="endpoint" data-testid="endpoint">
      <div className="section-title">OpenAI endpoint</div>
      <NotServing deployment={deployment} />
      <dl className="kv endpoint-kv">
        <dt>Base URL</dt>
        <dd>
          <code data-testid="endpoint-base-url">{base}</code> <CopyButton text={base} testId="endpoint-base-url-copy" />
        </dd>
        <dt>Model</dt>
        <dd>
          <code data-testid="endpoint-model">{deployment.name}</code>{" "}
          <CopyButton text={deployment.name} testId="endpoint-model-copy" />
        </dd>
      </dl>
      <p className="muted small">
        Clients send an <Link to="/tokens">API token</Link> as the API key. The snippets read it from{" "}
        <code>{TOKEN_ENV}</code>: <code>export {TOKEN_ENV}=of_…</code> first.
      </p>
      <div className="tabs snippet-tabs" role="tablist">
        {(["curl", "python"] as const).map((t) => (
          <button
            key={t}
            type="button"
            role="tab"
            aria-selected={tab === t}
            className={`tab${tab === t ? " active" : ""}`}
            onClick={() => setTab(t)}
            data-testid={`snippet-tab-${t}`}
          >
            {t === "curl" ? "curl" : "Python (openai)"}
          </button>
        ))}
      </div>
      {/* Both stay in the page (one hidden), so either can be copied whichever tab is open. */}
      <div hidden={tab !== "curl"}>
        <CopyBlock text={curlSnippet(base, deployment.name)} testId="snippet-curl" />
      </div>
      <div hidden={tab !== "python"}>
        <CopyBlock text={pythonSnippet(base, deployment.name)} testId="snippet-python" />
      </div>
    </section>
  );
}
