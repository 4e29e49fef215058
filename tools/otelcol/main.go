// Command otelcol is a minimal OpenTelemetry Collector for the tests
// (tests/otel): OTLP receiver (gRPC + HTTP), batch processor, file and
// debug exporters. Laid out as the collector builder (ocb) would generate
// it, written by hand so it builds from pinned Go modules with no extra tool.
// Built and cached by tests/cluster/build otelcol.
package main

import (
	"log"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/otelcol"
)

// version is set by tests/cluster/build (-X main.version=...).
var version = "dev"

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol",
			Description: "agents test collector (otlp -> batch -> file, debug)",
			Version:     version,
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
				},
			},
		},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		log.Fatalf("collector server run finished with error: %v", err)
	}
}
