/** The user's API tokens: make one (its text shown once, to copy), see when each was last used, revoke. */
import { type FormEvent, useCallback, useEffect, useState } from "react";
import { Link } from "react-router-dom";
import { describeError } from "../api/client";
import { tokens } from "../api/studio";
import type { ApiToken, NewApiToken } from "../api/types";
import { CopyBlock, CopyButton } from "../components/CopyButton";
import { useToast } from "../components/toast";
import { Button, EmptyState, ErrorBox, Modal, Spinner, Timestamp } from "../components/ui";
import { TOKEN_ENV } from "../deployments/snippets";

export function TokensPage() {
  const [list, setList] = useState<ApiToken[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [name, setName] = useState("");
  const [busy, setBusy] = useState(false);
  const [created, setCreated] = useState<NewApiToken | null>(null);
  const [revoking, setRevoking] = useState<ApiToken | null>(null);
  const toast = useToast();

  const load = useCallback(
    () =>
      tokens
        .list()
        .then((l) => {
          setList(l);
          setError(null);
        })
        .catch((err) => setError(describeError(err))),
    [],
  );
  useEffect(() => {
    load();
  }, [load]);

  const create = async (e: FormEvent) => {
    e.preventDefault();
    setBusy(true);
    try {
      const made = await tokens.create(name.trim());
      setCreated(made);
      setName("");
      load();
    } catch (err) {
      setError(describeError(err));
    } finally {
      setBusy(false);
    }
  };

  const revoke = async (token: ApiToken) => {
    try {
      await tokens.revoke(token.id);
      toast(`Revoked ${token.name || token.prefix}: it no longer works`, "success");
      if (created?.id === token.id) setCreated(null);
    } catch (err) {
      toast(describeError(err), "error");
    } finally {
      setRevoking(null);
      load();
    }
  };

  return (
    <div className="page" data-testid="tokens-page">
      <header className="page-head">
        <div>
          <h1>API tokens</h1>
          <p className="muted">
            A token stands for you on the REST API (<code>Authorization: Bearer …</code>) and as the API key of an OpenAI
            client on a chat deployment's <code>/v1</code> endpoint (see <Link to="/deployments">Deployments</Link>).
            Only its hash is kept: its text is shown once, when you make it.
          </p>
        </div>
      </header>
      {error && <ErrorBox>{error}</ErrorBox>}

      <form className="card pad token-form" onSubmit={create} aria-label="New token">
        <label className="field">
          <span className="field-label">New token</span>
          <input
            value={name}
            onChange={(e) => setName(e.target.value)}
            placeholder="what it is for, e.g. laptop, CI"
            maxLength={100}
            data-testid="token-name"
          />
        </label>
        <Button type="submit" variant="primary" icon="key" disabled={busy} data-testid="token-create">
          Create token
        </Button>
      </form>

      {created && (
        <div className="card pad token-created" data-testid="token-created">
          <strong>
            Token “{created.name || created.prefix}”: copy it now, it will not be shown again
          </strong>
          <div className="token-secret-row">
            <code className="token-secret" data-testid="token-secret">
              {created.token}
            </code>
            <CopyButton text={created.token} testId="token-copy" />
          </div>
          <p className="muted small">In a shell, for the deployments' snippets:</p>
          <CopyBlock text={`export ${TOKEN_ENV}=${created.token}`} testId="token-export" />
          <Button small variant="ghost" onClick={() => setCreated(null)}>
            I have copied it
          </Button>
        </div>
      )}

      {!list && !error && <Spinner label="Loading tokens" />}
      {list && list.length === 0 && (
        <EmptyState icon="key" title="No tokens">
          Make one above to call the API or a chat deployment from a script.
        </EmptyState>
      )}
      {list && list.length > 0 && (
        <div className="card">
          <table className="table" data-testid="tokens-table">
            <thead>
              <tr>
                <th>Name</th>
                <th>Token</th>
                <th>Created</th>
                <th>Last used</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {list.map((t) => (
                <tr key={t.id} data-testid="token-row" data-name={t.name} data-used={t.last_used_at ? "yes" : "no"}>
                  <td>{t.name || <span className="muted">unnamed</span>}</td>
                  <td className="mono small">{t.prefix}…</td>
                  <td className="small nowrap"><Timestamp iso={t.created_at} ago="inline" /></td>
                  <td className="small" data-testid="token-last-used">
                    {t.last_used_at ? <Timestamp iso={t.last_used_at} ago="inline" /> : <span className="muted">never</span>}
                  </td>
                  <td className="right">
                    <Button small variant="ghost" icon="trash" onClick={() => setRevoking(t)} data-testid="token-revoke">
                      Revoke
                    </Button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      <p className="muted small">Last use is recorded at most once a minute.</p>

      {revoking && (
        <Modal
          title={`Revoke “${revoking.name || revoking.prefix}”?`}
          onClose={() => setRevoking(null)}
          testId="token-revoke-dialog"
          footer={
            <>
              <Button onClick={() => setRevoking(null)}>Cancel</Button>
              <Button variant="danger" icon="trash" onClick={() => revoke(revoking)} data-testid="token-revoke-confirm">
                Revoke
              </Button>
            </>
          }
        >
          <p>Every script and client using it is refused from now on (401). This cannot be undone.</p>
        </Modal>
      )}
    </div>
  );
}
