package main

// A minimal collector self-telemetry factory: logs to stderr at a configurable
// level; no internal metrics or traces (so no :8888 Prometheus listener).
// It replaces service/telemetry/otelconftelemetry, which links cloud resource
// detectors and k8s.io/client-go (about 220 more packages, a slower cold build).
//
// Config (service.telemetry in the collector config):
//
//	telemetry:
//	  logs:
//	    level: info   # debug|info|warn|error
//	    encoding: console   # console|json

import (
	"context"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/service/telemetry"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

type telemetryConfig struct {
	Logs telemetryLogs `mapstructure:"logs"`
}

type telemetryLogs struct {
	Level    zapcore.Level `mapstructure:"level"`
	Encoding string        `mapstructure:"encoding"`
}

func newTelemetryFactory() telemetry.Factory {
	return telemetry.NewFactory(
		func() component.Config {
			return &telemetryConfig{Logs: telemetryLogs{Level: zapcore.InfoLevel, Encoding: "console"}}
		},
		telemetry.WithCreateLogger(createLogger),
	)
}

func createLogger(_ context.Context, set telemetry.LoggerSettings, c component.Config) (*zap.Logger, component.ShutdownFunc, error) {
	cfg := c.(*telemetryConfig)
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(cfg.Logs.Level)
	zc.Encoding = cfg.Logs.Encoding
	zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	zc.Sampling = nil
	build := set.BuildZapLogger
	if build == nil {
		build = zap.Config.Build
	}
	logger, err := build(zc)
	if err != nil {
		return nil, nil, err
	}
	return logger, func(context.Context) error { _ = logger.Sync(); return nil }, nil
}
