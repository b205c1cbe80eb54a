/** The frame around every signed-in page: navigation on the left, the page on the right. */
import { useEffect, useRef, useState } from "react";
import { Link, NavLink, Outlet, useLocation, useNavigate } from "react-router-dom";
import { useAuth } from "../auth";
import { Icon, type IconName } from "./icons";

const NAV: { to: string; label: string; icon: IconName }[] = [
  { to: "/workflows", label: "Workflows", icon: "flow" },
  { to: "/runs", label: "Runs", icon: "list" },
  { to: "/deployments", label: "Deployments", icon: "rocket" },
  { to: "/cluster", label: "Cluster", icon: "server" },
];

export function Shell() {
  const { user, logout } = useAuth();
  const navigate = useNavigate();
  // The editor and the run view need the width: the navigation shrinks to icons there.
  const compact = /^\/(workflows|runs)\/[^/]+/.test(useLocation().pathname);
  return (
    <div className={`shell${compact ? " compact" : ""}`}>
      <nav className="sidebar" aria-label="Main">
        <div className="brand">
          <img src="/favicon.svg" alt="" width={26} height={26} />
          <div className="brand-text">
            <div className="brand-name">Omni-Flow</div>
            <div className="brand-sub">Studio</div>
          </div>
        </div>
        <ul className="nav">
          {NAV.map((item) => (
            <li key={item.to}>
              <NavLink
                to={item.to}
                title={item.label}
                className={({ isActive }) => `nav-link${isActive ? " active" : ""}`}
              >
                <Icon name={item.icon} />
                <span className="nav-label">{item.label}</span>
              </NavLink>
            </li>
          ))}
        </ul>
        <div className="sidebar-foot">
          <UserMenu username={user?.username ?? ""} />
          <button
            type="button"
            className="icon-btn on-dark"
            title="Sign out"
            aria-label="Sign out"
            onClick={async () => {
              await logout();
              navigate("/login");
            }}
          >
            <Icon name="logout" />
          </button>
        </div>
      </nav>
      <main className="main">
        <Outlet />
      </main>
    </div>
  );
}

/** The signed-in user; a click opens their menu (API tokens). */
function UserMenu({ username }: { username: string }) {
  const [open, setOpen] = useState(false);
  const ref = useRef<HTMLDivElement>(null);
  useEffect(() => {
    if (!open) return;
    const away = (e: MouseEvent) => ref.current?.contains(e.target as Node) || setOpen(false);
    const escape = (e: KeyboardEvent) => e.key === "Escape" && setOpen(false);
    document.addEventListener("mousedown", away);
    document.addEventListener("keydown", escape);
    return () => {
      document.removeEventListener("mousedown", away);
      document.removeEventListener("keydown", escape);
    };
  }, [open]);
  return (
    <div className="user-menu-wrap" ref={ref}>
      <button
        type="button"
        className="user"
        aria-haspopup="menu"
        aria-expanded={open}
        title="Your account"
        onClick={() => setOpen((o) => !o)}
        data-testid="user-menu"
      >
        <span className="avatar">{username.slice(0, 1).toUpperCase()}</span>
        <span className="user-name" data-testid="current-user">
          {username}
        </span>
      </button>
      {open && (
        <div className="menu user-menu" role="menu">
          <div className="menu-note">Signed in as {username}</div>
          <Link to="/tokens" role="menuitem" onClick={() => setOpen(false)} data-testid="menu-tokens">
            <Icon name="key" size={14} /> API tokens
          </Link>
          <Link to="/deployments" role="menuitem" onClick={() => setOpen(false)} data-testid="menu-deployments">
            <Icon name="rocket" size={14} /> Deployments
          </Link>
        </div>
      )}
    </div>
  );
}
