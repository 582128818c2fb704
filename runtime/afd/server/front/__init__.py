"""Moving requests between attention ranks: `afd up`'s front door (`door`, its `metrics`), a rank's failover relay
(`failover`), and the splice that continues a relayed stream on another rank when its rank dies (`splice`)."""
