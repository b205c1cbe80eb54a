// Vite builds the studio into dist/, which Django serves (studio/spa): index.html for
// every page path and the hashed bundles under /assets/. `npm run dev` proxies the API
// and the WebSockets to a studio on 127.0.0.1:8000 (OMNIFLOW_STUDIO overrides it).
import react from "@vitejs/plugin-react";
import { defineConfig } from "vitest/config";

const studio = process.env.OMNIFLOW_STUDIO ?? "http://127.0.0.1:8000";

export default defineConfig({
  plugins: [react()],
  base: "/",
  build: {
    outDir: "dist",
    assetsDir: "assets",
    sourcemap: false,
    chunkSizeWarningLimit: 1200,
  },
  server: {
    proxy: {
      "/api": { target: studio, changeOrigin: false },
      "/ws": { target: studio.replace(/^http/, "ws"), ws: true },
      "/healthz": studio,
    },
  },
  test: {
    include: ["src/**/*.test.ts"],
    environment: "node",
  },
});
