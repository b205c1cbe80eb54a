import { BrowserRouter, Navigate, Route, Routes } from "react-router-dom";
import { AuthProvider, RequireAuth } from "./auth";
import { Shell } from "./components/Shell";
import { ToastProvider } from "./components/toast";
import { ClusterPage } from "./pages/ClusterPage";
import { DeploymentPage } from "./pages/DeploymentPage";
import { DeploymentsPage } from "./pages/DeploymentsPage";
import { EditorPage } from "./pages/EditorPage";
import { LoginPage } from "./pages/LoginPage";
import { NewRunPage } from "./pages/NewRunPage";
import { RunPage } from "./pages/RunPage";
import { RunsPage } from "./pages/RunsPage";
import { TokensPage } from "./pages/TokensPage";
import { WorkflowsPage } from "./pages/WorkflowsPage";

export function App() {
  return (
    <BrowserRouter>
      <ToastProvider>
        <AuthProvider>
          <Routes>
            <Route path="/login" element={<LoginPage />} />
            <Route
              element={
                <RequireAuth>
                  <Shell />
                </RequireAuth>
              }
            >
              <Route path="/" element={<Navigate to="/workflows" replace />} />
              <Route path="/workflows" element={<WorkflowsPage />} />
              <Route path="/workflows/:id" element={<EditorPage />} />
              <Route path="/workflows/:id/run" element={<NewRunPage />} />
              <Route path="/runs" element={<RunsPage />} />
              <Route path="/runs/:id" element={<RunPage />} />
              <Route path="/cluster" element={<ClusterPage />} />
              <Route path="/deployments" element={<DeploymentsPage />} />
              <Route path="/deployments/:id" element={<DeploymentPage />} />
              <Route path="/tokens" element={<TokensPage />} />
              <Route path="*" element={<NotFound />} />
            </Route>
          </Routes>
        </AuthProvider>
      </ToastProvider>
    </BrowserRouter>
  );
}

function NotFound() {
  return (
    <div className="page">
      <div className="empty">
        <h2>Page not found</h2>
        <p>There is nothing at this address.</p>
      </div>
    </div>
  );
}
