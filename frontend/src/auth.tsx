/** Who is logged in: the session from /api/auth/session/, login and logout. */
import { createContext, type ReactNode, useCallback, useContext, useEffect, useState } from "react";
import { Navigate, useLocation, useNavigate } from "react-router-dom";
import { request, setCsrfToken, setUnauthorizedHandler } from "./api/client";
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

/** The user this browser last signed in as (display only; the server decides access). */
const USER_KEY = "omniflow.user";

/**
 * Who is signed in. The session endpoint names the user; when it answers `user: null`
 * although the session cookie is valid (the studio's session view reports the request's
 * user after DRF has reset it to anonymous), an authenticated probe decides, and the
 * name comes from the last sign-in in this browser.
 */
async function currentUser(): Promise<User | null> {
  const s = await auth.session();
  setCsrfToken(s.csrf_token);
  if (s.user) return s.user;
  const signedIn = await request<unknown>("GET", "/api/tokens/", { allow: [401, 403] });
  if (signedIn === null) return null;
  const remembered = window.localStorage.getItem(USER_KEY);
  return remembered ? (JSON.parse(remembered) as User) : { id: 0, username: "signed in", is_staff: false };
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
    if (s.user) window.localStorage.setItem(USER_KEY, JSON.stringify(s.user));
    setUser(s.user);
  }, []);

  const logout = useCallback(async () => {
    await auth.logout();
    window.localStorage.removeItem(USER_KEY);
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
