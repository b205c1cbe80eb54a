import { type FormEvent, useState } from "react";
import { Navigate, useLocation, useNavigate } from "react-router-dom";
import { describeError } from "../api/client";
import { useAuth } from "../auth";
import { Button, ErrorBox } from "../components/ui";

export function LoginPage() {
  const { user, ready, login } = useAuth();
  const navigate = useNavigate();
  const location = useLocation();
  const state = (location.state ?? {}) as { from?: string; expired?: boolean };
  const [username, setUsername] = useState("");
  const [password, setPassword] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);

  if (ready && user) return <Navigate to={state.from ?? "/workflows"} replace />;

  const submit = async (e: FormEvent) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      await login(username, password);
      navigate(state.from && state.from !== "/login" ? state.from : "/workflows", { replace: true });
    } catch (err) {
      setError(describeError(err));
    } finally {
      setBusy(false);
    }
  };

  return (
    <div className="login-screen">
      <form className="login-card" onSubmit={submit} aria-label="Sign in">
        <div className="login-brand">
          <img src="/favicon.svg" alt="" width={40} height={40} />
          <div>
            <h1>Omni-Flow Studio</h1>
            <p className="muted">Design, run and watch multimodal inference workflows.</p>
          </div>
        </div>
        {state.expired && !error && <div className="info-box">Your session ended; sign in again.</div>}
        {error && <ErrorBox>{error}</ErrorBox>}
        <label className="field">
          <span className="field-label">Username</span>
          <input
            name="username"
            autoComplete="username"
            value={username}
            onChange={(e) => setUsername(e.target.value)}
            autoFocus
            required
          />
        </label>
        <label className="field">
          <span className="field-label">Password</span>
          <input
            name="password"
            type="password"
            autoComplete="current-password"
            value={password}
            onChange={(e) => setPassword(e.target.value)}
            required
          />
        </label>
        <Button variant="primary" type="submit" disabled={busy} className="btn-block">
          {busy ? "Signing in…" : "Sign in"}
        </Button>
        <p className="muted small">
          A local studio has a demo account: <code>manage.py setup_demo</code> prints its login.
        </p>
      </form>
    </div>
  );
}
