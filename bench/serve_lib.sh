# Sourced by the benchmark scripts: one way to start a server on loopback and stop it.
#   start_server SERVER CONFIG LOG   starts SERVER --config=CONFIG (output to LOG), waits for its port
#                                    file (5 min at most), sets SERVER_PID and TARGET (host:port of
#                                    gRPC); returns 1, printing LOG, when it does not come up. The
#                                    caller's environment reaches the server.
#   stop_server                      SIGTERM and wait.
start_server() {
  local bin=$1 config=$2 log=$3
  local ports="$log.ports.json"
  rm -f "$ports"
  "$bin" --config="$config" --port_file="$ports" >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 6000); do
    [ -s "$ports" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.05
  done
  if [ ! -s "$ports" ]; then
    echo "server did not start ($config):"
    cat "$log"
    kill "$SERVER_PID" 2>/dev/null || true
    return 1
  fi
  TARGET=$(sed -E 's/.*"grpc_address": "([^"]+)".*/\1/' "$ports")
}

stop_server() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
}
