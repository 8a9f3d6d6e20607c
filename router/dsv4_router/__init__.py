"""The PD router: its own service in front of prefill + decode (or monolithic) engines, with
static, admin-registered or Kubernetes-discovered workers."""
