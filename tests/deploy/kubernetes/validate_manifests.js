// Validates every document of the Kubernetes manifests given on the command line:
//
//  1. against the Kubernetes API schemas (npm's kubernetes-models) and the Prometheus Operator's
//     (@kubernetes-models/prometheus-operator): each document's apiVersion and kind must be a type
//     these packages know, and its body must pass that type's validate(). Those schemas allow
//     fields they do not define, so every field of a built-in kind is also looked up in the
//     official client's model of that kind (@kubernetes/client-node's attribute maps, generated
//     from the API's OpenAPI document): a field it does not know (a typo such as readinesProbe) is
//     a problem, as the API server's strict field validation would reject it. (The Prometheus
//     Operator's kinds are CRDs the client does not model: schema only.)
//  2. against each other, for what no schema can see: every Service, the PodDisruptionBudget and the
//     ServiceMonitor select the Deployment's pods (or, for the ServiceMonitor, exactly one Service);
//     Service target ports and the ServiceMonitor's port are ports that exist; the HPA scales the
//     Deployment; the volumes the container mounts exist and the ConfigMap it mounts is defined.
//
// Before the manifests, it runs itself on documents that are wrong in known ways and fails unless
// it reports each of them, so a validator that accepts everything cannot pass.
//
//   node validate_manifests.js deploy/kubernetes/*.yaml     (with this folder's node_modules: npm ci)
//
// Exit status 0 when everything is valid, 1 otherwise (each problem on its own line).
"use strict";

const fs = require("fs");
const path = require("path");
const YAML = require("yaml");
const k8s = require("@kubernetes/client-node");

// apiVersion -> the module that holds its kinds.
function modelModule(apiVersion) {
  const candidates = [
    `kubernetes-models/${apiVersion}`,
    `@kubernetes-models/prometheus-operator/${apiVersion}`,
  ];
  for (const name of candidates) {
    try {
      return require(name);
    } catch (e) {
      if (e.code !== "MODULE_NOT_FOUND" && e.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED") throw e;
    }
  }
  return null;
}

// Schema problems of one document, as strings (empty when valid).
function schemaProblems(doc) {
  if (!doc || typeof doc !== "object") return ["not a mapping"];
  const { apiVersion, kind } = doc;
  if (typeof apiVersion !== "string" || typeof kind !== "string") return ["no apiVersion or kind"];
  const mod = modelModule(apiVersion);
  if (!mod) return [`unknown apiVersion ${apiVersion}`];
  const Model = mod[kind];
  if (typeof Model !== "function") return [`unknown kind ${kind} in ${apiVersion}`];
  try {
    new Model(doc).validate();
  } catch (e) {
    return [String(e.message || e)];
  }
  const model = clientModel(apiVersion, kind);
  if (!model) return [];
  const unknown = [];
  const { apiVersion: _a, kind: _k, ...body } = doc;
  unknownFields(body, model, kind, unknown);
  return unknown;
}

// The client's model type of a built-in kind: apps/v1 Deployment -> "V1Deployment",
// autoscaling/v2 HorizontalPodAutoscaler -> "V2HorizontalPodAutoscaler". Null for other kinds.
function clientModel(apiVersion, kind) {
  const version = apiVersion.split("/").pop();
  const name = version.charAt(0).toUpperCase() + version.slice(1) + kind;
  const model = k8s[name];
  return typeof model === "function" && typeof model.getAttributeTypeMap === "function" ? name : null;
}

// Fields of `value` (of the client's type `type`) that the type does not define, as paths.
function unknownFields(value, type, at, out) {
  if (value === null || value === undefined) return;
  const array = /^Array<(.+)>$/.exec(type);
  if (array) {
    if (Array.isArray(value)) value.forEach((v, i) => unknownFields(v, array[1], `${at}[${i}]`, out));
    return;
  }
  const map = /^\{ \[key: string\]: (.+); \}$/.exec(type);
  if (map) {
    if (typeof value === "object") for (const [k, v] of Object.entries(value)) unknownFields(v, map[1], `${at}.${k}`, out);
    return;
  }
  const model = k8s[type];
  // Primitives, IntOrString, free-form objects: nothing to look up (the schema checks types).
  if (typeof model !== "function" || typeof model.getAttributeTypeMap !== "function") return;
  if (typeof value !== "object" || Array.isArray(value)) return;
  const known = new Map(model.getAttributeTypeMap().map((a) => [a.baseName, a.type]));
  for (const [k, v] of Object.entries(value)) {
    if (!known.has(k)) out.push(`${at}.${k}: unknown field (not in ${type})`);
    else unknownFields(v, known.get(k), `${at}.${k}`, out);
  }
}

function matches(selector, labels) {
  return Object.entries(selector || {}).every(([k, v]) => labels && labels[k] === v);
}

// Cross-document problems of a whole set of documents.
function crossProblems(docs) {
  const problems = [];
  const of = (kind) => docs.filter((d) => d && d.kind === kind);
  const deployments = of("Deployment");
  if (deployments.length !== 1) return [`expected one Deployment, found ${deployments.length}`];
  const deployment = deployments[0];
  const pod = deployment.spec.template;
  const podLabels = pod.metadata.labels;
  if (!matches(deployment.spec.selector.matchLabels, podLabels)) {
    problems.push("Deployment: selector does not match its own pod template");
  }
  const containerPorts = new Map();
  for (const c of pod.spec.containers) {
    for (const p of c.ports || []) containerPorts.set(p.name, p.containerPort);
    const volumes = new Set((pod.spec.volumes || []).map((v) => v.name));
    for (const m of c.volumeMounts || []) {
      if (!volumes.has(m.name)) problems.push(`container ${c.name}: mounts undefined volume ${m.name}`);
    }
  }
  const configMaps = new Set(of("ConfigMap").map((c) => c.metadata.name));
  for (const v of pod.spec.volumes || []) {
    if (v.configMap && !configMaps.has(v.configMap.name)) {
      problems.push(`volume ${v.name}: ConfigMap ${v.configMap.name} is not defined`);
    }
  }
  const services = of("Service");
  for (const s of services) {
    if (!matches(s.spec.selector, podLabels)) {
      problems.push(`Service ${s.metadata.name}: selector matches no pod of the Deployment`);
    }
    for (const p of s.spec.ports) {
      const target = p.targetPort === undefined ? p.port : p.targetPort;
      const known = typeof target === "string" ? containerPorts.has(target)
                                               : [...containerPorts.values()].includes(target);
      if (!known) problems.push(`Service ${s.metadata.name}: targetPort ${target} is no container port`);
    }
  }
  const headless = services.filter((s) => s.spec.clusterIP === "None");
  if (headless.length !== 1) problems.push(`expected one headless Service, found ${headless.length}`);
  for (const pdb of of("PodDisruptionBudget")) {
    if (!matches(pdb.spec.selector.matchLabels, podLabels)) {
      problems.push(`PodDisruptionBudget ${pdb.metadata.name}: selector matches no pod`);
    }
  }
  for (const sm of of("ServiceMonitor")) {
    const selected = services.filter((s) => matches(sm.spec.selector.matchLabels, s.metadata.labels));
    if (selected.length !== 1) {
      problems.push(`ServiceMonitor ${sm.metadata.name}: selects ${selected.length} Services, not 1`);
      continue;
    }
    for (const e of sm.spec.endpoints) {
      if (!selected[0].spec.ports.some((p) => p.name === e.port)) {
        problems.push(`ServiceMonitor ${sm.metadata.name}: Service has no port ${e.port}`);
      }
    }
  }
  for (const hpa of of("HorizontalPodAutoscaler")) {
    const t = hpa.spec.scaleTargetRef;
    if (t.kind !== "Deployment" || t.name !== deployment.metadata.name) {
      problems.push(`HorizontalPodAutoscaler ${hpa.metadata.name}: scales ${t.kind}/${t.name}`);
    }
  }
  for (const kind of ["PodDisruptionBudget", "ServiceMonitor", "HorizontalPodAutoscaler"]) {
    if (of(kind).length === 0) problems.push(`no ${kind}`);
  }
  return problems;
}

function readDocuments(file) {
  const problems = [];
  const docs = [];
  for (const d of YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))) {
    if (d.errors.length) problems.push(`${file}: YAML: ${d.errors.map((e) => e.message).join("; ")}`);
    const value = d.toJS();
    if (value !== null && value !== undefined) docs.push(value);
  }
  return { docs, problems };
}

// The validator on documents that are wrong: each must be reported.
function selfTest() {
  const failures = [];
  const container = { name: "c", image: "i" };
  const broken = {
    "a port that is a string": {
      apiVersion: "apps/v1", kind: "Deployment", metadata: { name: "d" },
      spec: { selector: { matchLabels: { a: "b" } },
              template: { metadata: { labels: { a: "b" } },
                          spec: { containers: [{ ...container, ports: [{ containerPort: "80" }] }] } } },
    },
    "an unknown kind": { apiVersion: "v1", kind: "Servce", metadata: { name: "s" } },
    "an unknown API group": { apiVersion: "monitoring.example.com/v1", kind: "ServiceMonitor" },
    "a ServiceMonitor without endpoints' type": {
      apiVersion: "monitoring.coreos.com/v1", kind: "ServiceMonitor", metadata: { name: "m" },
      spec: { selector: {}, endpoints: "metrics" },
    },
    "a misspelt field (readinesProbe)": {
      apiVersion: "apps/v1", kind: "Deployment", metadata: { name: "d" },
      spec: { selector: { matchLabels: { a: "b" } },
              template: { metadata: { labels: { a: "b" } },
                          spec: { containers: [{ ...container, readinesProbe: { tcpSocket: { port: 1 } } }] } } },
    },
    "an unknown field at the top of a ConfigMap": {
      apiVersion: "v1", kind: "ConfigMap", metadata: { name: "c" }, datta: { a: "b" },
    },
    "an unknown field inside a map's values (Service port)": {
      apiVersion: "v1", kind: "Service", metadata: { name: "s" }, spec: { ports: [{ port: 1, targetPrt: 2 }] },
    },
    "an HPA metric without a target": {
      apiVersion: "autoscaling/v2", kind: "HorizontalPodAutoscaler", metadata: { name: "h" },
      spec: { scaleTargetRef: { kind: "Deployment", name: "d" }, maxReplicas: 2,
              metrics: [{ type: "Pods", pods: { metric: { name: "q" } } }] },
    },
  };
  for (const [what, doc] of Object.entries(broken)) {
    if (schemaProblems(doc).length === 0) failures.push(`self-test: ${what} was accepted`);
  }
  const valid = {
    apiVersion: "policy/v1", kind: "PodDisruptionBudget", metadata: { name: "p" },
    spec: { minAvailable: 1, selector: { matchLabels: { a: "b" } } },
  };
  if (schemaProblems(valid).length !== 0) failures.push(`self-test: a valid PDB was refused: ${schemaProblems(valid)}`);
  const deployment = broken["a port that is a string"];
  const wrongSelector = [deployment, { apiVersion: "v1", kind: "Service", metadata: { name: "s" },
                                       spec: { selector: { a: "x" }, ports: [{ port: 1 }] } }];
  if (!crossProblems(wrongSelector).some((p) => p.includes("selector matches no pod"))) {
    failures.push("self-test: a Service selecting no pod was accepted");
  }
  return failures;
}

function main(files) {
  if (files.length === 0) {
    console.error("usage: node validate_manifests.js MANIFEST.yaml...");
    return 2;
  }
  const problems = selfTest();
  const all = [];
  for (const file of files) {
    const { docs, problems: yamlProblems } = readDocuments(file);
    problems.push(...yamlProblems);
    docs.forEach((doc, i) => {
      const where = `${path.basename(file)}#${i} ${doc.kind}/${doc.metadata && doc.metadata.name}`;
      const found = schemaProblems(doc);
      if (found.length) problems.push(...found.map((p) => `${where}: ${p}`));
      else console.log(`valid: ${where} (${doc.apiVersion})`);
      all.push(doc);
    });
  }
  problems.push(...crossProblems(all));
  for (const p of problems) console.log(`FAIL: ${p}`);
  console.log(`${all.length} documents, ${problems.length} problems`);
  return problems.length === 0 ? 0 : 1;
}

process.exitCode = main(process.argv.slice(2));
