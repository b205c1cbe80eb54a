/** Who is logged in: the session from /api/auth/session/, login and logout. */
import { createContext, type ReactNode, useCallback, useContext, useEffect, useState } from "react";
import { Navigate, useLocation, useNavigate } from "react-router-dom";
import { setCsrfToken, setUnauthorizedHandler } from "./api/client";
import { auth } from "./api/studio";
import type { User } from "./api/types";
import { Spinner } from "./components/ui";

interface AuthState {
  user: User | null;
  ready: boolean;
  login: (username: string, password: string) => Promise<void>;
  logout: () => Promise<void>;
}

const AuthContext = createContext<AuthState | null>(null);

/** Who is signed in: the session endpoint names the session's user (null when signed out). */
async function currentUser(): Promise<User | null> {
  const s = await auth.session();
  setCsrfToken(s.csrf_token);
  return s.user;
}

export function AuthProvider({ children }: { children: ReactNode }) {
  const [user, setUser] = useState<User | null>(null);
  const [ready, setReady] = useState(false);
  const navigate = useNavigate();

  useEffect(() => {
    currentUser()
      .then(setUser)
      .catch(() => setUser(null))
      .finally(() => setReady(true));
  }, []);

  useEffect(() => {
    setUnauthorizedHandler(() => {
      setUser(null);
      navigate("/login", { replace: true, state: { from: window.location.pathname, expired: true } });
    });
    return () => setUnauthorizedHandler(null);
  }, [navigate]);

  const login = useCallback(async (username: string, password: string) => {
    // A fresh CSRF token first: the login form may have sat open across a server restart.
    setCsrfToken((await auth.session()).csrf_token);
    const s = await auth.login(username, password);
    setCsrfToken(s.csrf_token);
    setUser(s.user);
  }, []);

  const logout = useCallback(async () => {
    await auth.logout();
    setUser(null);
    const s = await auth.session();
    setCsrfToken(s.csrf_token);
  }, []);

  return <AuthContext.Provider value={{ user, ready, login, logout }}>{children}</AuthContext.Provider>;
}

export function useAuth(): AuthState {
  const state = useContext(AuthContext);
  if (!state) throw new Error("useAuth outside AuthProvider");
  return state;
}

export function RequireAuth({ children }: { children: ReactNode }) {
  const { user, ready } = useAuth();
  const location = useLocation();
  if (!ready) {
    return (
      <div className="center-screen">
        <Spinner />
      </div>
    );
  }
  if (!user) return <Navigate to="/login" replace state={{ from: location.pathname + location.search }} />;
  return <>{children}</>;
}
