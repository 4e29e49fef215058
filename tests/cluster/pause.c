/* Minimal pod sandbox "pause" process for the test cluster's own pause image.
 * Sleeps forever, exits cleanly on SIGINT/SIGTERM, reaps zombies (PID 1). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }
static void on_chld(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(void) {
	struct sigaction term = {.sa_handler = on_term}, chld = {.sa_handler = on_chld, .sa_flags = SA_NOCLDSTOP};
	sigaction(SIGINT, &term, NULL);
	sigaction(SIGTERM, &term, NULL);
	sigaction(SIGCHLD, &chld, NULL);
	for (;;) pause();
	return 1;
}
