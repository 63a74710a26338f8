# Sourced by the end-to-end shell tests (openai_sdk_e2e_test.sh, placement_page_test.sh,
# python_package_test.sh): waiting for a server started in the background, reading its port file,
# and a throwaway CA with a server certificate.

# wait_for_port_file PID PORT_FILE LOG: returns once the server PID wrote PORT_FILE; prints LOG and
# exits 1 when the server exits first or 60 s pass.
wait_for_port_file() {
  local pid=$1 ports=$2 log=$3
  for _ in $(seq 600); do
    [ -s "$ports" ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "FAILED: server exited"; exit 1; }
    sleep 0.1
  done
  cat "$log"; echo "FAILED: no port file after 60 s"; exit 1
}

# json_field FILE KEY: the string KEY of the JSON object in FILE.
json_field() {
  /usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

# make_test_certificates DIR SAN: DIR/ca.{key,crt}, a CA of the test's own, and DIR/server.{key,crt}
# signed by it for SAN (e.g. "DNS:localhost,IP:127.0.0.1"; the first DNS name is its CN). Exits 1
# with openssl's output when openssl fails.
make_test_certificates() {
  local dir=$1 san=$2 cn
  cn=$(sed -E 's/^DNS:([^,]+).*/\1/' <<<"$san")
  mkdir -p "$dir"
  (
    cd "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt \
      -days 2 -subj /CN=stowage-test-ca -addext basicConstraints=critical,CA:TRUE \
      -addext keyUsage=critical,keyCertSign,cRLSign
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr \
      -subj "/CN=$cn"
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$san" >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2 \
      -extfile server.ext
  ) >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log"; echo "FAILED: openssl"; exit 1; }
}
