/** The frame around every signed-in page: navigation on the left, the page on the right. */
import { NavLink, Outlet, useLocation, useNavigate } from "react-router-dom";
import { useAuth } from "../auth";
import { Icon, type IconName } from "./icons";

const NAV: { to: string; label: string; icon: IconName }[] = [
  { to: "/workflows", label: "Workflows", icon: "flow" },
  { to: "/runs", label: "Runs", icon: "list" },
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
          <div className="user">
            <span className="avatar">{user?.username.slice(0, 1).toUpperCase()}</span>
            <span className="user-name" data-testid="current-user">
              {user?.username}
            </span>
          </div>
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
