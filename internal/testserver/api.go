package testserver

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// listResourceVersion is the resourceVersion of every list: objects never
// change, so the collection stays at one version.
const listResourceVersion = "1000"

type resource struct {
	name, singular, kind string
	namespaced           bool
	shortNames           []string
	items                []map[string]any // sorted by namespace, name
}

type api struct {
	s         *Server
	resources map[string]*resource
	order     []string
}

var namespaces = []string{"default", "kube-node-lease", "kube-public", "kube-system"}

func newAPI(s *Server) *api {
	a := &api{s: s, resources: map[string]*resource{}}
	add := func(name, singular, kind string, namespaced bool, shortNames ...string) *resource {
		r := &resource{name: name, singular: singular, kind: kind, namespaced: namespaced, shortNames: shortNames}
		a.resources[name] = r
		a.order = append(a.order, name)
		return r
	}
	rv := 1
	obj := func(r *resource, ns, name string, extra map[string]any) {
		md := map[string]any{
			"name":              name,
			"uid":               fmt.Sprintf("00000000-0000-0000-0000-%012d", rv),
			"resourceVersion":   strconv.Itoa(rv),
			"creationTimestamp": "2024-01-01T00:00:00Z",
		}
		if ns != "" {
			md["namespace"] = ns
		}
		o := map[string]any{"apiVersion": "v1", "kind": r.kind, "metadata": md}
		for k, v := range extra {
			o[k] = v
		}
		r.items = append(r.items, o)
		rv++
	}

	nodes := add("nodes", "node", "Node", false, "no")
	for i := 0; i < s.opts.Nodes; i++ {
		name := fmt.Sprintf("node-%d", i)
		obj(nodes, "", name, map[string]any{
			"spec": map[string]any{},
			"status": map[string]any{
				"conditions": []any{map[string]any{"type": "Ready", "status": "True"}},
				"nodeInfo":   map[string]any{"kubeletVersion": "v1.31.14"},
			},
		})
		nodes.items[i]["metadata"].(map[string]any)["labels"] = map[string]any{"kubernetes.io/hostname": name}
	}
	nss := add("namespaces", "namespace", "Namespace", false, "ns")
	for _, ns := range namespaces {
		obj(nss, "", ns, map[string]any{"spec": map[string]any{}, "status": map[string]any{"phase": "Active"}})
	}
	cms := add("configmaps", "configmap", "ConfigMap", true, "cm")
	for _, ns := range namespaces {
		obj(cms, ns, "kube-root-ca.crt", map[string]any{"data": map[string]any{"ca.crt": "placeholder"}})
	}
	sas := add("serviceaccounts", "serviceaccount", "ServiceAccount", true, "sa")
	for _, ns := range namespaces {
		obj(sas, ns, "default", nil)
	}
	pods := add("pods", "pod", "Pod", true, "po")
	for i := 0; i < s.opts.Nodes; i++ {
		obj(pods, "kube-system", fmt.Sprintf("kube-proxy-%d", i), map[string]any{
			"spec":   map[string]any{"nodeName": fmt.Sprintf("node-%d", i), "containers": []any{map[string]any{"name": "kube-proxy", "image": "registry.k8s.io/kube-proxy:v1.31.14"}}},
			"status": map[string]any{"phase": "Running"},
		})
	}
	svcs := add("services", "service", "Service", true, "svc")
	obj(svcs, "default", "kubernetes", map[string]any{"spec": map[string]any{"clusterIP": "10.96.0.1", "ports": []any{map[string]any{"name": "https", "port": 443, "protocol": "TCP"}}}})
	eps := add("endpoints", "endpoints", "Endpoints", true, "ep")
	obj(eps, "default", "kubernetes", nil)
	add("secrets", "secret", "Secret", true)
	add("events", "event", "Event", true, "ev")
	add("limitranges", "limitrange", "LimitRange", true, "limits")
	add("resourcequotas", "resourcequota", "ResourceQuota", true, "quota")
	add("persistentvolumeclaims", "persistentvolumeclaim", "PersistentVolumeClaim", true, "pvc")
	add("persistentvolumes", "persistentvolume", "PersistentVolume", false, "pv")
	add("replicationcontrollers", "replicationcontroller", "ReplicationController", true, "rc")
	add("podtemplates", "podtemplate", "PodTemplate", true)
	sort.Strings(a.order)
	return a
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(code)
	_, _ = w.Write(b)
}

// writeStatus answers with a metav1.Status, as kube-apiserver does on errors.
func writeStatus(w http.ResponseWriter, code int, reason, message string, details map[string]any) {
	st := map[string]any{
		"kind":       "Status",
		"apiVersion": "v1",
		"metadata":   map[string]any{},
		"status":     "Failure",
		"message":    message,
		"reason":     reason,
		"code":       code,
	}
	if details != nil {
		st["details"] = details
	}
	writeJSON(w, code, st)
}

func notFound(w http.ResponseWriter) {
	writeStatus(w, http.StatusNotFound, "NotFound", "the server could not find the requested resource", nil)
}

func (a *api) serve(w http.ResponseWriter, r *http.Request, user string, groups []string, done <-chan struct{}) {
	path := strings.TrimSuffix(r.URL.Path, "/")
	switch path {
	case "/version":
		writeJSON(w, 200, map[string]any{
			"major": "1", "minor": "31", "gitVersion": "v1.31.14-testserver",
			"gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
			"buildDate": "2024-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64",
		})
		return
	case "/healthz", "/livez", "/readyz":
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok")
		return
	case "/api":
		writeJSON(w, 200, map[string]any{
			"kind": "APIVersions", "versions": []string{"v1"},
			"serverAddressByClientCIDRs": []any{map[string]any{"clientCIDR": "0.0.0.0/0", "serverAddress": a.s.Addr()}},
		})
		return
	case "/apis":
		writeJSON(w, 200, map[string]any{
			"kind": "APIGroupList", "apiVersion": "v1",
			"groups": []any{map[string]any{
				"name":             "authentication.k8s.io",
				"versions":         []any{map[string]any{"groupVersion": "authentication.k8s.io/v1", "version": "v1"}},
				"preferredVersion": map[string]any{"groupVersion": "authentication.k8s.io/v1", "version": "v1"},
			}},
		})
		return
	case "/apis/authentication.k8s.io/v1":
		writeJSON(w, 200, map[string]any{
			"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "authentication.k8s.io/v1",
			"resources": []any{map[string]any{"name": "selfsubjectreviews", "singularName": "selfsubjectreview", "namespaced": false, "kind": "SelfSubjectReview", "verbs": []string{"create"}}},
		})
		return
	case "/apis/authentication.k8s.io/v1/selfsubjectreviews":
		if r.Method != http.MethodPost {
			writeStatus(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "the server does not allow this method on the requested resource", nil)
			return
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
		if groups == nil {
			groups = []string{}
		}
		writeJSON(w, http.StatusCreated, map[string]any{
			"kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1",
			"metadata": map[string]any{"creationTimestamp": nil},
			"status":   map[string]any{"userInfo": map[string]any{"username": user, "groups": append(append([]string{}, groups...), "system:authenticated")}},
		})
		return
	case "/api/v1":
		var list []any
		for _, name := range a.order {
			res := a.resources[name]
			list = append(list, map[string]any{
				"name": res.name, "singularName": res.singular, "namespaced": res.namespaced, "kind": res.kind,
				"verbs": []string{"get", "list", "watch"}, "shortNames": res.shortNames,
			})
		}
		writeJSON(w, 200, map[string]any{"kind": "APIResourceList", "groupVersion": "v1", "resources": list})
		return
	}
	if !strings.HasPrefix(path, "/api/v1/") {
		notFound(w)
		return
	}
	parts := strings.Split(strings.TrimPrefix(path, "/api/v1/"), "/")
	var ns, resName, name string
	switch {
	case len(parts) == 5 && parts[0] == "namespaces" && parts[2] == "pods" && parts[4] == "log":
		a.podLog(w, r, parts[1], parts[3], done)
		return
	case len(parts) >= 3 && parts[0] == "namespaces":
		ns, resName = parts[1], parts[2]
		if len(parts) == 4 {
			name = parts[3]
		} else if len(parts) > 4 {
			notFound(w)
			return
		}
	case len(parts) <= 2:
		resName = parts[0]
		if len(parts) == 2 {
			name = parts[1]
		}
	default:
		notFound(w)
		return
	}
	res, ok := a.resources[resName]
	if !ok || (ns != "" && !res.namespaced) {
		notFound(w)
		return
	}
	q := r.URL.Query()
	watch := q.Get("watch") == "true" || q.Get("watch") == "1"
	verb := "list"
	switch {
	case r.Method != http.MethodGet:
		verb = strings.ToLower(r.Method)
		if r.Method == http.MethodPost {
			verb = "create"
		}
	case watch:
		verb = "watch"
	case name != "":
		verb = "get"
	}
	if az := a.s.opts.Authorize; az != nil && !az(Attributes{User: user, Groups: groups, Verb: verb, Resource: res.name, Namespace: ns, Name: name}) {
		a.s.forbidden.Add(1)
		scope := "at the cluster scope"
		if ns != "" {
			scope = fmt.Sprintf("in the namespace %q", ns)
		}
		subject := res.name
		if name != "" {
			subject = fmt.Sprintf("%s %q", res.name, name)
		}
		writeStatus(w, http.StatusForbidden, "Forbidden",
			fmt.Sprintf("%s is forbidden: User %q cannot %s resource %q in API group \"\" %s", subject, user, verb, res.name, scope),
			map[string]any{"name": name, "kind": res.name})
		return
	}
	if r.Method != http.MethodGet {
		writeStatus(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "the server does not allow this method on the requested resource", nil)
		return
	}
	items := res.select_(ns, name, q.Get("fieldSelector"))
	if name != "" && !watch {
		if len(items) == 0 {
			writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("%s %q not found", res.name, name),
				map[string]any{"name": name, "kind": res.name})
			return
		}
		writeJSON(w, 200, items[0])
		return
	}
	if watch {
		a.watch(w, r, res, items, done)
		return
	}
	writeJSON(w, 200, map[string]any{
		"kind": res.kind + "List", "apiVersion": "v1",
		"metadata": map[string]any{"resourceVersion": listResourceVersion},
		"items":    items,
	})
}

// select_ returns the items in namespace ns ("" = all) named name ("" = all)
// matching a metadata.name / metadata.namespace field selector.
func (res *resource) select_(ns, name, fieldSelector string) []map[string]any {
	for _, term := range strings.Split(fieldSelector, ",") {
		k, v, ok := strings.Cut(term, "=")
		if !ok {
			continue
		}
		v = strings.TrimPrefix(v, "=")
		switch k {
		case "metadata.name":
			name = v
		case "metadata.namespace":
			ns = v
		}
	}
	out := make([]map[string]any, 0, len(res.items))
	for _, it := range res.items {
		md := it["metadata"].(map[string]any)
		if ns != "" && md["namespace"] != ns {
			continue
		}
		if name != "" && md["name"] != name {
			continue
		}
		out = append(out, it)
	}
	return out
}

// watch streams watch events like kube-apiserver: ADDED for every object when
// the client starts from resourceVersion "" or "0" or asks for initial
// events (then a bookmark marks their end), then periodic bookmarks when
// allowed, until the client goes, timeoutSeconds pass, or the server stops.
func (a *api) watch(w http.ResponseWriter, r *http.Request, res *resource, items []map[string]any, done <-chan struct{}) {
	if !a.s.addWatcher(done) {
		return
	}
	defer a.s.watchers.Done()
	ctx, cancel := watchContext(r, done)
	defer cancel()
	q := r.URL.Query()
	flusher, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-cache, private")
	w.WriteHeader(http.StatusOK)
	enc := json.NewEncoder(w)
	send := func(typ string, obj any) bool {
		if err := enc.Encode(map[string]any{"type": typ, "object": obj}); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	bookmark := func(annotations map[string]any) bool {
		md := map[string]any{"resourceVersion": listResourceVersion}
		if annotations != nil {
			md["annotations"] = annotations
		}
		return send("BOOKMARK", map[string]any{"kind": res.kind, "apiVersion": "v1", "metadata": md})
	}
	rv := q.Get("resourceVersion")
	initial := q.Get("sendInitialEvents") == "true"
	if rv == "" || rv == "0" || initial {
		for _, it := range items {
			if !send("ADDED", it) {
				return
			}
		}
	}
	allowBookmarks := q.Get("allowWatchBookmarks") == "true"
	if initial && !bookmark(map[string]any{"k8s.io/initial-events-end": "true"}) {
		return
	}
	if flusher != nil {
		flusher.Flush() // send headers even when there is no event
	}
	var timeout <-chan time.Time
	if s, err := strconv.Atoi(q.Get("timeoutSeconds")); err == nil && s > 0 {
		t := time.NewTimer(time.Duration(s) * time.Second)
		defer t.Stop()
		timeout = t.C
	}
	var tick <-chan time.Time
	if allowBookmarks && a.s.opts.BookmarkInterval > 0 {
		t := time.NewTicker(a.s.opts.BookmarkInterval)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-timeout:
			return
		case <-tick:
			if !bookmark(nil) {
				return
			}
		}
	}
}

// podLog serves a pod's log as kube-apiserver does: plain text, and with
// follow=true a stream that writes a line every LogInterval until the client
// goes or the server stops (kubectl logs -f).
func (a *api) podLog(w http.ResponseWriter, r *http.Request, ns, name string, done <-chan struct{}) {
	if len(a.resources["pods"].select_(ns, name, "")) == 0 {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("pods %q not found", name), map[string]any{"name": name, "kind": "pods"})
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	if r.URL.Query().Get("follow") != "true" {
		_, _ = fmt.Fprintf(w, "%s: line 0\n", name)
		return
	}
	if !a.s.addWatcher(done) {
		return
	}
	defer a.s.watchers.Done()
	ctx, cancel := watchContext(r, done)
	defer cancel()
	flusher, _ := w.(http.Flusher)
	tick := time.NewTicker(a.s.opts.LogInterval)
	defer tick.Stop()
	for i := 0; ; i++ {
		if _, err := fmt.Fprintf(w, "%s: line %d\n", name, i); err != nil {
			return
		}
		if flusher != nil {
			flusher.Flush()
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
