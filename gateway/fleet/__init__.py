"""State shared by several gateway replicas in Redis ([redis]): slot leases, tenant
quotas, fleet signals. Everything here degrades to local state when Redis does."""
